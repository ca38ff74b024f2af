"""``AgentEndpoint``: an OpenAI-compatible HTTP server in front of a ``GenerationInterface``.

Started by envloop on ``127.0.0.1`` (a free port by default), served by uvicorn on a daemon
thread with its own event loop, stopped by :meth:`AgentEndpoint.stop` (or leaving its
``with`` block). Each agent run gets a session (:meth:`AgentEndpoint.open_session`) whose
``base_url`` names it; what the policy sampled in it is recorded token for token.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from typing import Any

import uvicorn

from envloop.agents.app import ChatService, build_app
from envloop.agents.chat_requests import BackendSampling
from envloop.agents.sessions import Session
from envloop.agents.tool_calls import tool_call_parser
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["AgentEndpoint"]


class AgentEndpoint:
    """An OpenAI-compatible endpoint serving ``policy``.

    Args:
        policy: the generation backend (``HfGeneration``, ``ServerGeneration``, ...).
        tokenizer: the policy's tokenizer (its chat template renders requests).
        max_seq_len: no conversation grows past this many tokens (a response is cut to
            fit; a prompt with no room left is refused with ``context_length_exceeded``).
            None: only ``max_tokens`` and the backend's own cap limit responses.
        model: the model name ``/v1/models`` lists.
        tool_call_format: ``hermes`` or ``llama3`` (see :mod:`envloop.agents.tool_calls`);
            None: chosen from the chat template.
        host, port: where to listen; port 0 takes a free one.

    >>> from envloop.models.generation.scripted_generation import ScriptedGeneration
    >>> from envloop.models.tiny import build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> with AgentEndpoint(ScriptedGeneration(tokenizer, lambda p: "4"), tokenizer) as ep:
    ...     session = ep.open_session("demo")
    ...     session.base_url.endswith("/s/demo/v1")
    True
    """

    def __init__(
        self,
        policy: GenerationInterface,
        tokenizer: Any,
        *,
        max_seq_len: int | None = None,
        model: str = "envloop-policy",
        tool_call_format: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be an int >= 2 or None, got {max_seq_len!r}.")
        self.service = ChatService(
            policy, tokenizer, tool_call_parser(tokenizer, tool_call_format), model, max_seq_len,
            sampling=BackendSampling.of(policy),
        )  # fmt: skip
        self.host, self._port = host, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def port(self) -> int:
        """The port it listens on (known once started)."""
        if self._socket is None:
            raise RuntimeError("The endpoint is not started; call start() first.")
        return int(self._socket.getsockname()[1])

    @property
    def base_url(self) -> str:
        """``http://<host>:<port>/v1``: requests here are served but not recorded."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> AgentEndpoint:
        """Bind the port and serve on a daemon thread; returns once it accepts requests."""
        if self._server is not None:
            return self
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((self.host, self._port))
        config = uvicorn.Config(
            build_app(self.service), log_level="warning", lifespan="off", access_log=False,
            backlog=4096, timeout_keep_alive=600,
        )  # fmt: skip
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._socket]}, name="envloop-agent-endpoint",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"The agent endpoint did not start on {self.host}:{self._port} within "
                    f"{timeout_s} s (see the uvicorn error above)."
                )
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving (requests in flight get up to ``timeout_s`` to finish)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive() and server is not None:
                server.force_exit = True
                thread.join(timeout_s)
        if self._socket is not None:
            self._socket.close()

    def open_session(self, session_id: str | None = None) -> Session:
        """A new session, recorded from its first request; its ``base_url``
        (``http://127.0.0.1:<port>/s/<id>/v1``) is what the agent's client uses."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.service.sessions:
            raise ValueError(f"Session {session_id!r} is already open on this endpoint.")
        if not session_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(
                f"Session id {session_id!r} must be letters, digits, '-', '_' or '.' (it is "
                "part of a URL)."
            )
        session = Session(session_id, f"http://{self.host}:{self.port}/s/{session_id}/v1")
        self.service.sessions[session_id] = session
        return session

    def close_session(self, session_id: str) -> Session:
        """Stop serving the session and return it (its later requests get a 404)."""
        return self.service.sessions.pop(session_id)

    def __enter__(self) -> AgentEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
