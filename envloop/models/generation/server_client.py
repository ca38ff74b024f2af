"""Requests to inference servers over one pooled async HTTP client, with retries.

aiohttp's connection pool hands out a free connection in constant time, so the client's cost
per request does not grow with the number in flight (``benchmarks/server_client.py``
measures it); a semaphore bounds the requests in flight over all servers. A request that
cannot reach its server (refused connection, reset, timeout), gets a 5xx or 429 answer, or
gets an answer the dialect cannot read is retried after an exponential backoff with full
jitter, on whichever server the router picks then; after ``max_retries`` retries only that
row fails, with the last error as its text. A 4xx answer is the request's own fault and
fails its row at once, with the server's message.

Weight updates (:meth:`ServerClient.update_weights`) hold new attempts back until the
attempts in flight are answered, then reload every server (:mod:`server_weights`); each
row's tokens carry the policy version served when their attempt was sent.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import aiohttp

from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.server_config import ServerGenerationConfig
from envloop.models.generation.server_dialects import (
    ControlRequest,
    GenerationFailed,
    GenerationRequest,
    MalformedReply,
    Reply,
    RetryableFailure,
    Sampling,
    ServerDialect,
    WeightReload,
)
from envloop.models.generation.server_routing import ServerRouter, ServerSlot
from envloop.models.generation.server_weights import AttemptGate, ControlFailed, reload_servers

__all__ = ["GenerationFailed", "RetryableFailure", "ServerClient"]

MAX_BACKOFF_S = 30.0


class ServerClient:
    """Sends generation requests for one backend; lives on one event loop (:meth:`open`).

    ``version`` is the policy version the servers serve: 0, then what each successful
    :meth:`update_weights` set.
    """

    def __init__(
        self, config: ServerGenerationConfig, dialect: ServerDialect, vocab_size: int
    ) -> None:
        self.config, self.dialect, self.vocab_size = config, dialect, vocab_size
        self.router = ServerRouter(config.base_urls, base_set_aside_s=config.retry_backoff_s)
        self.counts = {"requests": 0, "retries": 0, "failed_rows": 0, "score_requests": 0}
        self.version = 0
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._server_slots: dict[str, asyncio.Semaphore] = {}
        self._gate: AttemptGate | None = None
        self._reloading: asyncio.Lock | None = None
        self._last_reload: WeightReload | None = None

    async def open(self) -> None:
        """Create the HTTP session and the concurrency bound on the running loop."""
        limit = self.config.max_concurrent_requests
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        self._slots = asyncio.Semaphore(limit)
        per_server = self.config.max_requests_per_server
        self._server_slots = {
            server.url: asyncio.Semaphore(per_server or limit) for server in self.router.servers
        }
        self._gate = AttemptGate()
        self._reloading = asyncio.Lock()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(
        self, request: GenerationRequest, sampling: Sampling, key: Any = None
    ) -> SampleResult:
        """One row's generation; a row that fails for good comes back with ``error`` set
        and no tokens, never as an exception. ``versions`` holds, for each token, the
        policy version served when the attempt that generated the tokens was sent."""
        if request.budget <= 0:
            return SampleResult(truncated=True)
        try:
            reply, version = await self._call(
                lambda server: self.dialect.body(request, sampling, server.media),
                key,
                lambda payload: _counted(
                    self.dialect.parse(payload), request, self.dialect.image_count_fix
                ),
            )
            logprobs = await self._complete_logprobs(request, sampling, reply, key)
        except GenerationFailed as exc:
            self.counts["failed_rows"] += 1
            return SampleResult(truncated=False, error=str(exc))
        if len(reply.tokens) > request.budget:  # a server that overran its max_tokens
            reply.tokens, logprobs = reply.tokens[: request.budget], logprobs[: request.budget]
            reply.finish = "length"
        versions = [version] * len(reply.tokens)
        return SampleResult(reply.tokens, logprobs, reply.finish == "length", versions=versions)

    async def probe(self, server: ServerSlot, token_id: int) -> Reply:
        """One probe request to ``server`` (no retries): its answer must carry token ids."""
        payload = await self._post(server, self.dialect.path, self.dialect.probe_body(token_id))
        return self.dialect.parse(payload)

    async def start(self, server: ServerSlot, vision: bool) -> None:
        """Ask ``server`` what the dialect needs to know before generating (``vision``:
        the served model takes images)."""
        await self.dialect.start(server, self.get_json, vision)

    async def admit(self, server: ServerSlot) -> None:
        """Let ``server``, which answered its probe request, take requests. After a weight
        update it first reloads that update's checkpoint, so that it serves the current
        version; raises :class:`RetryableFailure` if that fails (it stays out)."""
        assert self._reloading is not None
        async with self._reloading:
            if self._last_reload is not None:
                failed = await reload_servers(self.control, [server], self._last_reload)
                if failed:
                    raise RetryableFailure(
                        f"reloading the weights of version {self.version}: {failed[server.url]}"
                    )
            self.router.join(server)

    async def update_weights(self, reload: WeightReload, version: int) -> dict[str, str]:
        """Send ``reload``'s requests to every server that has joined once the attempts in
        flight are answered (new ones wait until all servers are done); ``version`` becomes
        the served version if every server reloaded (servers joining later reload it
        first: :meth:`admit`). Returns the error of each server that failed, by URL
        (empty: all reloaded)."""
        assert self._gate is not None and self._reloading is not None
        async with self._gate.closed(), self._reloading:
            failed = await reload_servers(self.control, self.router.joined, reload)
            if not failed:
                self.version, self._last_reload = version, reload
        return failed

    async def control(self, server: ServerSlot, request: ControlRequest) -> None:
        """``POST`` one weight-update request to ``server``; raises :class:`ControlFailed`
        unless it answers HTTP 200 without ``"success": false``."""
        assert self._session is not None
        url, what = server.url + request.path, f"POST {request.path}"
        data = None if request.body is None else json.dumps(request.body)
        headers = None if data is None else _JSON
        try:
            async with self._session.post(url, data=data, headers=headers) as reply:
                text, status = await reply.text(), reply.status
        except _UNREACHABLE as exc:
            reason = _describe(exc, self.config.request_timeout_s)
            raise ControlFailed(f"{what}: {reason}") from None
        if self.dialect.control_failed(status, text):
            raise ControlFailed(f"{what}: HTTP {status}: {text[:500]}")

    async def get_json(self, url: str) -> Any:
        """GET ``url``'s JSON; a server not (yet) answering raises :class:`RetryableFailure`."""
        assert self._session is not None
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise RetryableFailure(f"GET {url}: HTTP {response.status}")
                return await response.json(content_type=None)
        except _UNREACHABLE as exc:
            raise RetryableFailure(_describe(exc, self.config.request_timeout_s)) from None

    async def _call(
        self, body: Callable[[ServerSlot], dict[str, Any]], key: Any, parse: Any
    ) -> tuple[Any, int]:
        """POST ``body(server)`` to the dialect's path of the server the router picks and
        ``parse`` the answer, with retries; returns it with the policy version the
        answering attempt was sent under."""
        assert self._gate is not None
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            async with self._gate.admitted():
                version, server = self.version, self.router.acquire(key)
                self.counts["requests"] += 1
                answered = False
                try:  # released however it ends, a cancellation included
                    result = parse(await self._post(server, self.dialect.path, body(server)))
                    answered = True
                except (RetryableFailure, MalformedReply) as exc:
                    error = f"{server.url}{self.dialect.path}: {exc}"
                except GenerationFailed:
                    answered = True  # the server answered: the request was at fault
                    raise
                finally:
                    self.router.release(server, ok=answered)
            if answered:
                return result, version
            if attempt + 1 == attempts:
                raise GenerationFailed(
                    f"generation failed after {attempts} attempt(s); last: {error}"
                )
            self.counts["retries"] += 1
            await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    async def _post(self, server: ServerSlot, path: str, body: dict[str, Any]) -> Any:
        assert self._session is not None and self._slots is not None
        url = server.url + path
        async with self._server_slots[server.url], self._slots:
            try:
                async with self._session.post(url, data=json.dumps(body), headers=_JSON) as reply:
                    text = await reply.text()
                    status = reply.status
            except _UNREACHABLE as exc:
                raise RetryableFailure(_describe(exc, self.config.request_timeout_s)) from None
        if status == 429 or status >= 500:
            raise RetryableFailure(f"HTTP {status}: {text[:300]}")
        if status != 200:
            raise GenerationFailed(f"{url} rejected the request: HTTP {status}: {text[:500]}")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise MalformedReply(f"answer is not JSON: {text[:200]!r}") from None

    def _backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, base * 2^attempt], capped."""
        ceiling = min(self.config.retry_backoff_s * 2**attempt, MAX_BACKOFF_S)
        return random.uniform(0, ceiling)

    async def _complete_logprobs(
        self, request: GenerationRequest, sampling: Sampling, reply: Reply, key: Any
    ) -> list[float]:
        """``reply.logprobs`` with every gap filled by the dialect's follow-up requests."""
        if all(value is not None for value in reply.logprobs):
            return [float(v) for v in reply.logprobs]  # type: ignore[arg-type]

        async def follow_up(body: Callable[[ServerSlot], dict[str, Any]], parse: Any) -> Any:
            self.counts["score_requests"] += 1
            return (await self._call(body, key, parse))[0]

        return await self.dialect.fill_logprobs(
            request, sampling, reply, follow_up, self.vocab_size
        )


def _counted(reply: Reply, request: GenerationRequest, fix: str) -> Reply:
    """``reply``, after checking that a server given images counted the prompt's tokens as
    the processor did (``fix``: the dialect's way to make it)."""
    expected = len(request.prompt)
    if request.images is not None and reply.prompt_tokens not in (None, expected):
        raise GenerationFailed(
            f"the server read the prompt and its {len(request.images.png)} image(s) as "
            f"{reply.prompt_tokens} tokens, the processor as {expected}: it resized an image "
            f"or re-tokenized the text differently ({fix})"
        )
    return reply


_JSON = {"Content-Type": "application/json"}
_UNREACHABLE = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
"""What a request raises when its server cannot be reached or does not answer in time."""


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within request_timeout_s={timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
