"""Requests to inference servers over kept-alive connections, with retries.

Each server's requests go over its own :class:`~http_connections.HttpConnections`: a
connection is handed to the next request when its answer is read, so the client's cost per
request does not grow with the number in flight (``benchmarks/server_fleet.py client``
measures it). A semaphore bounds the requests in flight over all servers, and
``max_requests_per_server`` those at one server, which bounds its open connections.

A request that cannot reach its server (refused connection, reset, timeout), gets a 5xx
or 429 answer, or gets an answer the dialect cannot read is retried after an exponential
backoff with full jitter, on whichever server the router picks then; after ``max_retries``
retries only that row fails, with the last error as its text. A 4xx answer is the
request's own fault and fails its row at once, with the server's message.

Weight updates (:meth:`ServerClient.update_weights`) hold new attempts back until the
attempts in flight are answered, then reload every server (:mod:`server_weights`); each
row's tokens carry the policy version served when their attempt was sent.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.http_connections import HttpConnections
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
from envloop.models.generation.server_routing import NoServerTakes, ServerRouter, ServerSlot
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
        self._connections: dict[str, HttpConnections] = {}
        self._slots: asyncio.Semaphore | None = None
        self._server_slots: dict[str, asyncio.Semaphore] = {}
        self._gate: AttemptGate | None = None
        self._reloading: asyncio.Lock | None = None
        self._last_reload: WeightReload | None = None

    async def open(self) -> None:
        """Create each server's connections and the concurrency bounds on the running
        loop."""
        limit = self.config.max_concurrent_requests
        self._connections = {
            server.url: HttpConnections(server.url) for server in self.router.servers
        }
        self._slots = asyncio.Semaphore(limit)
        per_server = self.config.max_requests_per_server
        self._server_slots = {
            server.url: asyncio.Semaphore(per_server or limit) for server in self.router.servers
        }
        self._gate = AttemptGate()
        self._reloading = asyncio.Lock()

    async def close(self) -> None:
        for connections in self._connections.values():
            connections.close()

    async def generate(
        self, request: GenerationRequest, sampling: Sampling, key: Any = None
    ) -> SampleResult:
        """One row's generation; a row that fails for good comes back with ``error`` set
        and no tokens, never as an exception. ``versions`` holds, for each token, the
        policy version served when the attempt that generated the tokens was sent."""
        return (await self.generate_group(request, 1, sampling, (key,)))[0]

    async def generate_group(
        self, request: GenerationRequest, n: int, sampling: Sampling, keys: Sequence[Any]
    ) -> list[SampleResult]:
        """``n`` rows of ``request``'s prompt, budget and stop strings, row ``j`` sampled
        with seed ``request.seed + j`` (``keys``: their sample keys), as one request for
        ``n`` completions to a server that takes that many (``ServerSlot.parallel``), else
        split in halves, down to one request per row; each row's result is the one
        :meth:`generate` gives for it (same tokens, same failure rules). A request the
        server rejects (4xx, e.g. a server restarted with fewer slots than it listed) is
        sent again in halves, down to one row each; one that fails otherwise fails or
        retries all its rows together."""
        return await self._rows([request.shifted(j) for j in range(n)], sampling, keys, True)

    async def generate_batch(
        self, requests: Sequence[GenerationRequest], sampling: Sampling, keys: Sequence[Any]
    ) -> list[SampleResult]:
        """Rows of several text prompts that share a budget and stop strings, as one
        request listing their prompts (the dialect's :meth:`~ServerDialect.batch_body`) to
        a server that takes that many, else split in halves like :meth:`generate_group`.
        Only for rows whose seed does not matter (greedy, or unseeded), unless the dialect
        gives each listed prompt its own seed (``seeds_listed_prompts``); else the server
        samples every prompt of the list with the request's one seed. A request the server
        rejects (4xx) is sent again in halves, down to one row each, so that only the rows
        whose prompt it rejects fail; one that fails otherwise fails or retries all its
        rows."""
        return await self._rows(list(requests), sampling, keys, False)

    async def _rows(
        self, requests: list[GenerationRequest], sampling: Sampling, keys: Sequence[Any],
        one_prompt: bool,
    ) -> list[SampleResult]:  # fmt: skip
        """The rows of ``requests`` (one per row, sharing their budget and stop strings;
        ``one_prompt``: the samples of one prompt, seeds consecutive) as one request."""
        first, n = requests[0], len(requests)
        if first.budget <= 0:
            return [SampleResult(truncated=True) for _ in range(n)]
        body: Callable[[ServerSlot], dict[str, Any]]
        parse: Callable[[Any], Any]
        if n == 1:
            body = functools.partial(self._body, first, sampling)
            parse = functools.partial(self._parse, first)
        elif one_prompt:
            body = functools.partial(self._group_body, first, n, sampling)
            parse = functools.partial(self.dialect.parse_group, n=n)
        else:
            body = functools.partial(self._batch_body, requests, sampling)
            parse = functools.partial(self.dialect.parse_group, n=n)
        try:
            replies, version = await self._call(body, keys, parse, n)
        except GenerationFailed as exc:
            if isinstance(exc, RequestRejected) and n > 1:
                # a prompt of a list at fault, or a server restarted with fewer slots
                return await self._halves(requests, sampling, keys, one_prompt)
            self.counts["failed_rows"] += n
            return [SampleResult(truncated=False, error=str(exc)) for _ in range(n)]
        except NoServerTakes:
            return await self._halves(requests, sampling, keys, one_prompt)
        if n == 1:
            replies = [replies]
        results = [_gapless(r, reply, version) for r, reply in zip(requests, replies)]
        gaps = [j for j, result in enumerate(results) if result is None]
        if gaps:  # rows whose reply lacks log-probabilities: follow-up requests each
            filled = await asyncio.gather(
                *(self._row_result(requests[j], sampling, replies[j], version, keys[j])
                  for j in gaps)
            )  # fmt: skip
            for j, result in zip(gaps, filled):
                results[j] = result
        return results  # type: ignore[return-value]

    async def _halves(
        self, requests: list[GenerationRequest], sampling: Sampling, keys: Sequence[Any],
        one_prompt: bool,
    ) -> list[SampleResult]:  # fmt: skip
        """The rows of ``requests`` as two requests, each half of them."""
        half = len(requests) // 2
        halves = await asyncio.gather(
            self._rows(requests[:half], sampling, keys[:half], one_prompt),
            self._rows(requests[half:], sampling, keys[half:], one_prompt),
        )
        return halves[0] + halves[1]

    async def _row_result(
        self, request: GenerationRequest, sampling: Sampling, reply: Reply, version: int,
        key: Any,
    ) -> SampleResult:  # fmt: skip
        """One row's result from a reply with log-probability gaps: filled by follow-up
        requests (the row fails if that fails)."""
        try:
            logprobs = await self._complete_logprobs(request, sampling, reply, key)
        except GenerationFailed as exc:
            self.counts["failed_rows"] += 1
            return SampleResult(truncated=False, error=str(exc))
        return _row_tokens(request, reply.tokens, logprobs, reply.finish, version)

    def _body(
        self, request: GenerationRequest, sampling: Sampling, server: ServerSlot
    ) -> dict[str, Any]:
        return self.dialect.body(request, sampling, server.media)

    def _group_body(
        self, request: GenerationRequest, n: int, sampling: Sampling, server: ServerSlot
    ) -> dict[str, Any]:
        return self.dialect.group_body(request, n, sampling, server.media)

    def _batch_body(
        self, requests: list[GenerationRequest], sampling: Sampling, server: ServerSlot
    ) -> dict[str, Any]:
        return self.dialect.batch_body(requests, sampling, server.media)

    def _parse(self, request: GenerationRequest, payload: Any) -> Reply:
        return _counted(self.dialect.parse(payload), request, self.dialect.image_count_fix)

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
        what = f"POST {request.path}"
        data = None if request.body is None else json.dumps(request.body).encode()
        try:
            status, raw = await self._connections[server.url].request(
                "POST", request.path, data, self.config.request_timeout_s
            )
            text = raw.decode("utf-8", "replace")
        except _UNREACHABLE as exc:
            reason = _describe(exc, self.config.request_timeout_s)
            raise ControlFailed(f"{what}: {reason}") from None
        if self.dialect.control_failed(status, text):
            raise ControlFailed(f"{what}: HTTP {status}: {text[:500]}")

    async def get_json(self, url: str) -> Any:
        """GET ``url``'s JSON; a server not (yet) answering raises :class:`RetryableFailure`."""
        server_url = next((u for u in self._connections if url.startswith(u + "/")), None)
        if server_url is None:  # not a server's: a connection of its own
            connections, path = HttpConnections(url), ""
        else:
            connections, path = self._connections[server_url], url[len(server_url) :]
        try:
            status, raw = await connections.request(
                "GET", path, None, self.config.request_timeout_s
            )
        except _UNREACHABLE as exc:
            raise RetryableFailure(_describe(exc, self.config.request_timeout_s)) from None
        finally:
            if server_url is None:
                connections.close()
        if status != 200:
            raise RetryableFailure(f"GET {url}: HTTP {status}")
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise MalformedReply(f"GET {url}: the answer is not JSON: {raw[:200]!r}") from None

    async def _call(
        self, body: Callable[[ServerSlot], dict[str, Any]], keys: Sequence[Any], parse: Any,
        need: int = 1,
    ) -> tuple[Any, int]:  # fmt: skip
        """POST ``body(server)`` to the dialect's path of the server the router picks for
        the samples of ``keys`` (one taking ``need`` completions per request) and ``parse``
        the answer, with retries; returns it with the policy version the answering attempt
        was sent under. Raises :class:`NoServerTakes` when no joined server takes
        ``need``."""
        assert self._gate is not None
        attempts = self.config.max_retries + 1
        key, others = (keys[0], keys[1:]) if keys else (None, ())
        for attempt in range(attempts):
            async with self._gate.admitted():
                version = self.version
                server = self.router.acquire(key, need=need, keys=others)
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
                    self.router.release(server, ok=answered, n=need)
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
        assert self._slots is not None
        data = json.dumps(body).encode()
        async with self._server_slots[server.url], self._slots:
            try:
                status, raw = await self._connections[server.url].request(
                    "POST", path, data, self.config.request_timeout_s
                )
            except _UNREACHABLE as exc:
                raise RetryableFailure(_describe(exc, self.config.request_timeout_s)) from None
        if status == 429 or status >= 500:
            raise RetryableFailure(f"HTTP {status}: {_text(raw, 300)}")
        if status != 200:
            raise RequestRejected(
                f"{server.url + path} rejected the request: HTTP {status}: {_text(raw, 500)}"
            )
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise MalformedReply(f"answer is not JSON: {_text(raw, 200)!r}") from None

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
            return (await self._call(body, (key,), parse))[0]

        return await self.dialect.fill_logprobs(
            request, sampling, reply, follow_up, self.vocab_size
        )


class RequestRejected(GenerationFailed):
    """The server answered the request with a 4xx status (other than 429): the request is
    at fault, and sending it again as it is would not help. A request for several rows is
    sent again in halves, so that only the rows at fault fail (a prompt of a list, or
    completions beyond the slots of a server restarted with fewer)."""


def _gapless(request: GenerationRequest, reply: Reply, version: int) -> SampleResult | None:
    """The row's result from ``reply``, or None when some of its log-probabilities are
    missing (the dialect's follow-up requests fill them)."""
    logprobs = reply.logprobs
    if None in logprobs:
        return None
    return _row_tokens(request, reply.tokens, logprobs, reply.finish, version)  # type: ignore[arg-type]


def _row_tokens(
    request: GenerationRequest, tokens: list[int], logprobs: list[float], finish: str,
    version: int,
) -> SampleResult:  # fmt: skip
    """A row's tokens capped at its budget (a server that overran its max_tokens ends at
    the budget, truncated), every token labelled ``version``."""
    if len(tokens) > request.budget:
        tokens, logprobs, finish = tokens[: request.budget], logprobs[: request.budget], "length"
    return SampleResult(tokens, logprobs, finish == "length", versions=[version] * len(tokens))


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


_UNREACHABLE = (asyncio.TimeoutError, OSError)
"""What a request raises when its server cannot be reached or does not answer in time."""


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"no answer within request_timeout_s={timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _text(raw: bytes, limit: int) -> str:
    """The first ``limit`` characters of an answer's body, for an error message."""
    return raw[: limit * 4].decode("utf-8", "replace")[:limit]
