"""The ASGI app behind :class:`~envloop.agents.endpoint.AgentEndpoint`: the OpenAI routes,
each at ``/v1/...`` (no session: nothing is recorded) and ``/s/<session>/v1/...``.

- ``GET /v1/models``: the one model served.
- ``POST /v1/chat/completions``: a chat completion (JSON, or server-sent events with
  ``stream``), sampled from the policy; within a session, recorded
  (:mod:`envloop.agents.sessions`).

Every refusal has the OpenAI error shape (:mod:`envloop.agents.openai_errors`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from envloop.agents.chat_requests import BackendSampling, ChatRequest, parse_chat_request
from envloop.agents.completions import (
    Completion,
    completion_body,
    reply_message,
    reply_of,
    stream_events,
)
from envloop.agents.openai_errors import OpenAIError
from envloop.agents.sampling import sample_response
from envloop.agents.sessions import Session
from envloop.experience.rollout_metrics import PhaseTimer
from envloop.experience.sample_vision import SampleVision
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["ChatService", "build_app"]


@dataclass
class ChatService:
    """What the routes serve: the policy, its tokenizer, the tool-call parser, the
    sessions by id and the context length (None: only the backend's own caps)."""

    policy: GenerationInterface
    tokenizer: Any
    parser: Any
    model: str
    max_seq_len: int | None = None
    sessions: dict[str, Session] = field(default_factory=dict)
    sampling: BackendSampling = field(default_factory=BackendSampling)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    """Times ``generation`` (a rollout over agents sets its own)."""

    def session(self, session_id: str | None) -> Session:
        """The session named ``session_id``; None: a fresh one that is not kept."""
        if session_id is None:
            return Session(f"unrecorded-{uuid.uuid4().hex[:12]}", "")
        if session_id not in self.sessions:
            raise OpenAIError(
                f"No session {session_id!r} on this endpoint: use the base_url a session was "
                "opened with (AgentEndpoint.open_session) while it is open.",
                status=404,
                code="session_not_found",
            )
        return self.sessions[session_id]

    async def complete(self, session: Session, request: ChatRequest) -> Completion:
        """Sample the response to ``request`` and record it in ``session``."""
        async with session.lock:
            plan = session.plan(self.tokenizer, request.messages, request.tools)
            budget = self._budget(len(plan.prompt_ids), request.max_tokens)
            with self.timer.phase("generation"):
                sampled = await sample_response(
                    self.policy, self.tokenizer, plan.prompt_ids, budget, request.stop,
                    request.greedy, session.id, _vision_columns(plan.trajectory_so_far()),
                )  # fmt: skip
            if sampled.error is not None:
                raise OpenAIError(
                    f"The policy could not generate a response: {sampled.error}",
                    status=500,
                    type="server_error",
                )
            completion = reply_of(request, sampled, self.parser, len(plan.prompt_ids))
            session.record(plan, sampled.message, reply_message(completion), sampled.ended_with_eos)
            return completion

    def _budget(self, prompt_tokens: int, max_tokens: int | None) -> int:
        room = None if self.max_seq_len is None else self.max_seq_len - prompt_tokens
        if room is not None and room < 1:
            raise OpenAIError(
                f"This conversation is {prompt_tokens} tokens, and the endpoint's context "
                f"(max_seq_len) is {self.max_seq_len}: no room for a response. Shorten the "
                "conversation (e.g. drop old turns) or raise max_seq_len.",
                param="messages",
                code="context_length_exceeded",
            )
        limits = [n for n in (room, max_tokens) if n is not None]
        return min(limits) if limits else 2**31 - 1


def _vision_columns(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The generation input's vision columns for a prompt of ``messages`` (none when no
    message holds vision inputs)."""
    vision = SampleVision(1)
    vision.reset(0, messages)
    return vision.columns([0]) if vision.any else {}


def build_app(service: ChatService) -> Starlette:
    """The Starlette app serving ``service``."""

    async def models(request: Request) -> Response:
        service.session(request.path_params.get("session"))
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": service.model, "object": "model", "created": int(time.time()),
                     "owned_by": "envloop"}
                ],
            }
        )  # fmt: skip

    async def chat(request: Request) -> Response:
        session = service.session(request.path_params.get("session"))
        try:
            parsed = parse_chat_request(await _json(request), service.sampling)
            completion = await service.complete(session, parsed)
        except OpenAIError as error:
            session.request_errors.append(error.message)
            raise
        finally:
            session.requests += 1
        if parsed.stream:
            return StreamingResponse(
                _async(stream_events(completion, parsed, service.model)),
                media_type="text/event-stream",
            )
        return JSONResponse(completion_body(completion, parsed, service.model))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/s/{session}/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/s/{session}/v1/chat/completions", chat, methods=["POST"]),
    ]
    handlers: dict[Any, Any] = {
        OpenAIError: _openai_error,
        HTTPException: _http_error,
        Exception: _server_error,
    }
    return Starlette(routes=routes, exception_handlers=handlers)


async def _async(events: Iterator[str]) -> AsyncIterator[str]:
    """``events`` as an async iterator (Starlette would hop to a thread for each item of a
    plain one)."""
    for event in events:
        yield event


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIError(f"The request body is not valid JSON: {error}.") from None


async def _openai_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, OpenAIError)
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = (
        f"{request.method} {request.url.path}: {error.detail}. This endpoint serves "
        "GET /v1/models and POST /v1/chat/completions (also under /s/<session>/v1)."
    )
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = OpenAIError(message, status=error.status_code, type=kind).body()
    return JSONResponse(body, status_code=error.status_code)


async def _server_error(request: Request, error: Exception) -> Response:
    body = OpenAIError(
        f"The endpoint failed serving {request.url.path}: {type(error).__name__}: {error}",
        status=500,
        type="server_error",
    ).body()
    return JSONResponse(body, status_code=500)
