"""The OpenAI error shape: what the endpoint answers to a request it cannot serve.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status, as
the OpenAI API answers, so that the official SDK raises its own ``BadRequestError``,
``NotFoundError`` (and so on) carrying the message.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpenAIError", "bad_request"]


class OpenAIError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and the OpenAI error body.

    >>> error = bad_request("temperature must be >= 0, got -1", param="temperature")
    >>> error.status, error.body()["error"]["param"]
    (400, 'temperature')
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 ``invalid_request_error`` about ``param``."""
    return OpenAIError(message, param=param, code=code)
