"""A ``POST /v1/chat/completions`` body, checked and read into a :class:`ChatRequest`.

Every parameter the endpoint cannot honour is refused with a 400 in the OpenAI error shape
naming it and what to send instead; nothing is silently ignored except the purely
informational ``user``, ``metadata`` and ``store``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envloop.agents.openai_errors import bad_request

__all__ = ["BackendSampling", "ChatRequest", "parse_chat_request"]

ROLES = ("system", "developer", "user", "assistant", "tool")
INFORMATIONAL = ("user", "metadata", "store", "model")
KNOWN = (
    "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
    "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "stream",
    "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias",
    "response_format", "parallel_tool_calls", *INFORMATIONAL,
)  # fmt: skip


@dataclass(frozen=True)
class BackendSampling:
    """How the backend samples when not greedy: the only temperature and top_p a request
    may ask for (besides temperature 0, greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of(cls, policy: Any) -> BackendSampling:
        """The sampling of ``policy``'s ``config`` (``HfGeneration``, ``ServerGeneration``);
        temperature 1 and top_p 1 for a backend without one."""
        config = getattr(policy, "config", None)
        return cls(float(getattr(config, "temperature", 1.0)), float(getattr(config, "top_p", 1.0)))


@dataclass
class ChatRequest:
    """A checked chat completion request.

    Attributes:
        messages: the conversation, each ``{"role", "content", ...}`` with ``content`` a
            string or a list of parts (``{"type": "text", "text"}``, ``{"type": "image",
            "image": bytes}``), assistant ``tool_calls`` as the API sends them.
        tools: the function definitions (None: none given).
        parse_tool_calls: whether the response's tool calls are parsed (tools given and
            ``tool_choice`` not ``"none"``).
        greedy: temperature 0.
        max_tokens: the response's token cap (None: the backend's and the context's).
        stop: stop strings (None: EOS only).
        logprobs: whether the response carries each token's log-probability.
        stream: answer with server-sent events.
        include_usage: a last streamed chunk carries ``usage``.
        parallel_tool_calls: False keeps only the first parsed tool call.
        model: the model name the request gave (echoed back).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    parse_tool_calls: bool = False
    greedy: bool = False
    max_tokens: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True
    model: str = ""


def parse_chat_request(body: Any, sampling: BackendSampling) -> ChatRequest:
    """``body`` (the decoded JSON) as a :class:`ChatRequest`; raises :class:`OpenAIError`.

    >>> r = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
    ...                         "temperature": 0, "stop": "\\n"}, BackendSampling())
    >>> r.greedy, r.stop, r.messages[0]["content"]
    (True, ['\\n'], 'hi')
    """
    if not isinstance(body, Mapping):
        raise bad_request("The request body must be a JSON object.")
    unknown = [key for key in body if key not in KNOWN]
    if unknown:
        raise bad_request(
            f"Unrecognized request argument supplied: {', '.join(map(str, unknown))}. "
            f"This endpoint takes: {', '.join(KNOWN)}.",
            param=str(unknown[0]),
        )
    _check_unsupported(body)
    tools = _tools(body.get("tools"))
    parse_calls = _tool_choice(body.get("tool_choice"), tools)
    greedy = _greedy(body, sampling)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise bad_request("stream_options must be an object.", param="stream_options")
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(_messages(body.get("messages")))],
        tools=tools,
        parse_tool_calls=parse_calls,
        greedy=greedy,
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        logprobs=_logprobs(body),
        stream=stream,
        include_usage=bool(stream and options and options.get("include_usage")),
        parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        model=str(body.get("model") or ""),
    )


def _check_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise bad_request(
            f"n={body['n']!r}: this endpoint returns one choice per request; send n=1 (or "
            "leave it out) and make one request per sample.",
            param="n",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_request(
                f"{name}={body[name]!r}: the backend samples from the policy's own "
                "distribution (the trajectory's log-probabilities must be those it sampled "
                f"from), so penalties are not applied; leave {name} out or 0.",
                param=name,
            )
    if body.get("logit_bias"):
        raise bad_request(
            "logit_bias is not supported: it would change the distribution the recorded "
            "log-probabilities describe; leave it out.",
            param="logit_bias",
        )
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_request(
            f"response_format={response_format!r}: the backend has no constrained decoding; "
            "leave response_format out (or {'type': 'text'}) and ask for JSON in the prompt.",
            param="response_format",
        )


def _messages(value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list of messages.", param="messages")
    return value


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise bad_request(f"{where} must be an object with 'role' and 'content'.", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(
            f"{where}.role is {role!r}; it must be one of {', '.join(ROLES)}.",
            param=f"{where}.role",
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = message.get("content")
    calls = message.get("tool_calls")
    if content is None and not (role == "assistant" and calls):
        raise bad_request(f"{where}.content is missing.", param=f"{where}.content")
    out["content"] = _content(content, f"{where}.content")
    if calls:
        if role != "assistant":
            raise bad_request(f"{where}: only assistant messages carry tool_calls.", param=where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(
                f"{where}: a tool message needs the tool_call_id of the call it answers.",
                param=f"{where}.tool_call_id",
            )
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of parts.", param=where)
    parts = [_part(p, f"{where}[{k}]") for k, p in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        return {"type": "image", "image": _image_bytes(url, where)}
    raise bad_request(
        f"{where}: a content part must be {{'type': 'text', 'text': ...}} or {{'type': "
        f"'image_url', 'image_url': {{'url': 'data:image/png;base64,...'}}}}, got {part!r:.80}.",
        param=where,
    )


def _image_bytes(url: Any, where: str) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise bad_request(
            f"{where}: images must be sent inline as a base64 data URL "
            f"('data:image/png;base64,...'); got {str(url)[:60]!r}. The endpoint fetches "
            "nothing from the network.",
            param=where,
        )
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError) as error:
        raise bad_request(f"{where}: the data URL is not valid base64 ({error}).", where) from None


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise bad_request(
            f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}.",
            param=where,
        )
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools.", param="tools")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
        ):
            raise bad_request(
                f"tools[{k}] must be {{'type': 'function', 'function': {{'name', "
                "'description', 'parameters'}}}}.",
                param=f"tools[{k}]",
            )
    return [dict(tool) for tool in tools] or None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> bool:
    if choice in (None, "auto"):
        return tools is not None
    if choice == "none":
        return False
    raise bad_request(
        f"tool_choice={choice!r}: forcing a tool call needs constrained decoding, which this "
        "endpoint's backend does not do; send 'auto' (the model may call a tool) or 'none'.",
        param="tool_choice",
    )


def _greedy(body: Mapping[str, Any], sampling: BackendSampling) -> bool:
    temperature = _number(body, "temperature")
    if temperature == 0:
        if body.get("seed") is not None and not isinstance(body["seed"], int):
            raise bad_request("seed must be an integer.", param="seed")
        return True
    if temperature is not None and abs(temperature - sampling.temperature) > 1e-6:
        raise bad_request(
            f"temperature={temperature}: this endpoint's backend samples at temperature "
            f"{sampling.temperature} (set in its config); send that, 0 (greedy), or leave "
            "temperature out.",
            param="temperature",
        )
    top_p = _number(body, "top_p")
    if top_p is not None and abs(top_p - sampling.top_p) > 1e-6:
        raise bad_request(
            f"top_p={top_p}: this endpoint's backend samples with top_p {sampling.top_p} (set "
            "in its config); send that or leave top_p out.",
            param="top_p",
        )
    if body.get("seed") is not None:
        raise bad_request(
            "seed: the backend draws every sample from its own seeded generator (its config's "
            "seed), so a per-request seed cannot be honoured; leave seed out, or send "
            "temperature 0 for a deterministic response.",
            param="seed",
        )
    return False


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise bad_request(f"{name} must be a number >= 0, got {value!r}.", param=name)
    return float(value)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{name} must be an integer >= 1, got {value!r}.", param=name)
    return value


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(
            f"stop must be a non-empty string or a list of them, got {stop!r}.", param="stop"
        )
    return stops or None


def _logprobs(body: Mapping[str, Any]) -> bool:
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad_request(
            f"top_logprobs={top!r}: the backend reports only the sampled token's "
            "log-probability; send logprobs=true with top_logprobs 0 or left out.",
            param="top_logprobs",
        )
    return _flag(body, "logprobs")


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}.", param=name)
    return value
