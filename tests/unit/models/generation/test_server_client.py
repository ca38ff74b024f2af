"""ServerClient's retries and failures against real HTTP servers on 127.0.0.1, each scripted
to answer in the shape of llama.cpp's ``/completion`` or to fail in one way (5xx, 429, 4xx,
no JSON, no ``tokens``, no answer at all, a refused connection). They test our retry logic,
not compatibility with llama.cpp: ``tests/integration/test_llama_server.py`` runs a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.server_client import ServerClient
from envloop.models.generation.server_config import ServerGenerationConfig
from envloop.models.generation.server_dialects import (
    GenerationRequest,
    LlamaCppDialect,
    Sampling,
)

VOCAB = 512
REQUEST = GenerationRequest(prompt=[30, 31, 32], budget=12, stops=None, seed=5)
SAMPLED = Sampling(temperature=0.7, top_p=0.9, top_k=20, greedy=False)
TOKENS = [19, 95, 2]
PROBS = [1.0, 0.8463863730430603, 1.0]
GENERATED = SampleResult(
    TOKENS, [0.0, math.log(PROBS[1]), 0.0], truncated=False, versions=[0, 0, 0]
)
"""What a row gets from an answer of :func:`completion` with the defaults (policy version 0:
no weight update)."""

Answer = Callable[[dict[str, Any]], Awaitable[web.Response]]
"""A scripted server's answer to one request body."""


def completion(
    tokens: list[int] = TOKENS, probs: list[float] = PROBS, stop_type: str = "eos"
) -> dict[str, Any]:
    """A llama.cpp ``/completion`` answer (sampled: ``prob`` entries), one entry per token."""
    return {
        "index": 0,
        "content": "1}",
        "tokens": tokens,
        "id_slot": 0,
        "stop": True,
        "model": "policy-f32.gguf",
        "tokens_predicted": len(tokens),
        "tokens_evaluated": 3,
        "truncated": False,
        "stop_type": stop_type,
        "stopping_word": "",
        "completion_probabilities": [
            {"id": t, "token": "", "bytes": [], "prob": p, "top_probs": [{"id": t, "prob": p}]}
            for t, p in zip(tokens, probs)
        ],
    }


async def answer_ok(body: dict[str, Any]) -> web.Response:
    return web.json_response(completion())


async def unavailable(body: dict[str, Any]) -> web.Response:
    error = '{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
    return web.Response(status=503, text=error, content_type="application/json")


async def too_many_requests(body: dict[str, Any]) -> web.Response:
    return web.Response(status=429, text="Too Many Requests")


TOO_LONG = (
    '{"error":{"code":400,"message":"the request exceeds the available context size, try '
    'increasing it","type":"exceed_context_size_error","n_prompt_tokens":4100,"n_ctx":4096}}'
)


async def too_long(body: dict[str, Any]) -> web.Response:
    return web.Response(status=400, text=TOO_LONG, content_type="application/json")


async def html_page(body: dict[str, Any]) -> web.Response:
    return web.Response(status=200, text="<html><body>Bad Gateway</body></html>")


async def without_tokens(body: dict[str, Any]) -> web.Response:
    payload = completion()
    del payload["tokens"]
    return web.json_response(payload)


async def never(body: dict[str, Any]) -> web.Response:
    await asyncio.sleep(30)  # cancelled when the client gives up and disconnects
    return web.json_response(completion())


@dataclass
class ScriptedServer:
    """An HTTP server on 127.0.0.1 whose n-th ``/completion`` request gets ``script[n]`` (the
    last one for every later request); it records each body and its peak of requests in
    flight."""

    script: list[Answer]
    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        answer = self.script[min(len(self.bodies), len(self.script) - 1)]
        self.bodies.append(body)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            return await answer(body)
        finally:
            self.in_flight -= 1


@contextlib.asynccontextmanager
async def serving(*script: Answer) -> AsyncIterator[ScriptedServer]:
    """A :class:`ScriptedServer` listening on a free port for the ``async with`` block."""
    server = ScriptedServer(list(script))
    app = web.Application()
    app.router.add_post("/completion", server.handle)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield server
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def refusing_url() -> Iterator[str]:
    """The URL of a port that is bound but never listens: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def make_client(*urls: str, **options: Any) -> ServerClient:
    settings = {"retry_backoff_s": 0.01, "request_timeout_s": 10.0, "max_retries": 3, **options}
    config = ServerGenerationConfig(
        base_urls=list(urls), tokenizer="unused", dialect="llamacpp", **settings
    )
    return ServerClient(config, LlamaCppDialect(), vocab_size=VOCAB)


async def generate_one(
    client: ServerClient, request: GenerationRequest = REQUEST, key: Any = "sample-0"
) -> SampleResult:
    """One row generated by ``client`` on the running loop (opened and closed around it)."""
    await client.open()
    try:
        return await client.generate(request, SAMPLED, key)
    finally:
        await client.close()


def run_one(*script: Answer, **options: Any) -> tuple[SampleResult, ServerClient, ScriptedServer]:
    """One row generated against one server answering with ``script``, on a fresh loop."""

    async def scenario() -> tuple[SampleResult, ServerClient, ScriptedServer]:
        async with serving(*script) as server:
            client = make_client(server.url, **options)
            return await generate_one(client), client, server

    return asyncio.run(scenario())


def counts(requests: int, retries: int, failed_rows: int = 0, score_requests: int = 0) -> dict:
    return {
        "requests": requests,
        "retries": retries,
        "failed_rows": failed_rows,
        "score_requests": score_requests,
    }


@pytest.mark.parametrize("failing", [unavailable, too_many_requests], ids=["503", "429"])
def test_a_row_retried_after_failed_answers_gets_the_answer_that_came(failing):
    result, client, server = run_one(failing, failing, answer_ok)
    assert result == GENERATED
    assert client.counts == counts(requests=3, retries=2)
    body = LlamaCppDialect().body(REQUEST, SAMPLED)
    assert server.bodies == [body, body, body]  # a retried request keeps its seed


def test_a_4xx_answer_fails_the_row_at_once_with_the_servers_message():
    result, client, server = run_one(too_long, answer_ok)
    expected = f"{server.url}/completion rejected the request: HTTP 400: {TOO_LONG}"
    assert result == SampleResult([], [], truncated=False, error=expected)
    assert client.counts == counts(requests=1, retries=0, failed_rows=1)
    assert len(server.bodies) == 1
    assert [s.failures for s in client.router.servers] == [0]  # the server is not to blame


def test_an_answer_that_is_not_json_is_retried_then_fails_the_row():
    result, client, server = run_one(html_page, max_retries=2)
    assert result.error == (
        f"generation failed after 3 attempt(s); last: {server.url}/completion: "
        "answer is not JSON: '<html><body>Bad Gateway</body></html>'"
    )
    assert (result.tokens, result.logprobs, result.truncated) == ([], [], False)
    assert client.counts == counts(requests=3, retries=2, failed_rows=1)
    assert len(server.bodies) == 3


def test_an_answer_without_token_ids_is_retried_then_fails_the_row():
    result, client, server = run_one(without_tokens, max_retries=1)
    assert result.error == (
        f"generation failed after 2 attempt(s); last: {server.url}/completion: "
        "'tokens' missing or not a list"
    )
    assert client.counts == counts(requests=2, retries=1, failed_rows=1)


def test_a_server_that_never_answers_times_out_then_fails_the_row():
    result, client, server = run_one(never, max_retries=1, request_timeout_s=0.5)
    assert result.error == (
        f"generation failed after 2 attempt(s); last: {server.url}/completion: "
        "no answer within request_timeout_s=0.5 s"
    )
    assert client.counts == counts(requests=2, retries=1, failed_rows=1)
    assert len(server.bodies) == 2


def test_a_refused_connection_is_retried_then_fails_the_row():
    with refusing_url() as url:
        client = make_client(url, max_retries=2)
        result = asyncio.run(generate_one(client))
    port = url.rsplit(":", 1)[1]
    assert result.error.startswith(
        f"generation failed after 3 attempt(s); last: {url}/completion: "
        f"ConnectionRefusedError: cannot connect to 127.0.0.1:{port}: Connection refused"
    )
    assert client.counts == counts(requests=3, retries=2, failed_rows=1)


def test_a_row_without_budget_sends_no_request():
    no_budget = GenerationRequest(prompt=[30, 31, 32], budget=0, stops=None, seed=5)

    async def scenario() -> tuple[SampleResult, ServerClient, ScriptedServer]:
        async with serving(answer_ok) as server:
            client = make_client(server.url)
            return await generate_one(client, no_budget), client, server

    result, client, server = asyncio.run(scenario())
    assert result == SampleResult([], [], truncated=True)
    assert client.counts == counts(requests=0, retries=0)
    assert server.bodies == []


def test_a_retry_goes_to_another_server_when_one_refuses_connections():
    async def scenario(refused: str) -> tuple[SampleResult, ServerClient, ScriptedServer]:
        async with serving(answer_ok) as server:
            client = make_client(refused, server.url)
            # a clock that stands still: the refusing server's set-aside cannot lapse before
            # the retry (backoff and set-aside are both drawn from retry_backoff_s)
            client.router.clock = lambda: 0.0
            return await generate_one(client), client, server

    with refusing_url() as refused:
        result, client, server = asyncio.run(scenario(refused))
    assert result == GENERATED
    assert client.counts == counts(requests=2, retries=1)
    assert len(server.bodies) == 1
    down, up = client.router.servers
    assert (down.url, down.failures, down.down_until) == (refused, 1, 0.01)
    assert (up.failures, up.down_until) == (0, 0.0)
    assert [down.outstanding, up.outstanding] == [0, 0]


def test_a_gap_in_llama_cpp_probabilities_is_filled_by_a_scoring_request():
    async def gap_then_score(body: dict[str, Any]) -> web.Response:
        if body["n_predict"] == 1:  # the scoring request: candidates after prompt + [19]
            top = [{"id": 276, "prob": 0.5}, {"id": 95, "prob": 0.25}, {"id": 20, "prob": 0.25}]
            answer = completion([276], [0.5], stop_type="limit")
            answer["completion_probabilities"][0]["top_probs"] = top
            return web.json_response(answer)
        answer = completion()
        del answer["completion_probabilities"][1]  # token 95 ended mid-way through a character
        return web.json_response(answer)

    result, client, server = run_one(gap_then_score)
    assert result == SampleResult(TOKENS, [0.0, math.log(0.25), 0.0], False, versions=[0] * 3)
    assert client.counts == counts(requests=2, retries=0, score_requests=1)
    score_body = LlamaCppDialect().score_body(REQUEST, [19], SAMPLED, 64, 0)
    assert server.bodies[1] == score_body
    assert score_body["prompt"] == [30, 31, 32, 19]


def test_a_reply_longer_than_the_budget_is_cut_to_it_and_truncated():
    short = GenerationRequest(prompt=[30, 31, 32], budget=2, stops=None, seed=5)

    async def scenario() -> SampleResult:
        async with serving(answer_ok) as server:
            return await generate_one(make_client(server.url), short)

    cut = SampleResult(TOKENS[:2], GENERATED.logprobs[:2], True, versions=[0, 0])
    assert asyncio.run(scenario()) == cut


def test_concurrent_rows_stay_within_max_concurrent_requests():
    limit, rows = 16, 200

    async def scenario() -> tuple[list[SampleResult], ServerClient, ScriptedServer]:
        everyone_in = asyncio.Event()

        async def held_until_a_full_wave(body: dict[str, Any]) -> web.Response:
            # the first `limit` requests wait for each other: the peak reaches the limit
            # whatever the timing, and a request past it would show while they wait
            if server.in_flight >= limit:
                everyone_in.set()
            await asyncio.wait_for(everyone_in.wait(), timeout=10)
            await asyncio.sleep(0.002)
            return web.json_response(completion())

        async with serving(held_until_a_full_wave) as server:
            client = make_client(server.url, max_concurrent_requests=limit)
            await client.open()
            try:
                calls = [client.generate(REQUEST, SAMPLED, f"sample-{n}") for n in range(rows)]
                results = await asyncio.gather(*calls)
            finally:
                await client.close()
        return results, client, server

    results, client, server = asyncio.run(scenario())
    assert results == [GENERATED] * rows
    assert client.counts == counts(requests=rows, retries=0)
    assert len(server.bodies) == rows
    assert server.peak == limit


def test_a_cancelled_request_is_no_longer_outstanding():
    async def scenario() -> ServerClient:
        async with serving(never) as server:
            client = make_client(server.url)
            await client.open()
            try:
                row = asyncio.create_task(client.generate(REQUEST, SAMPLED, "sample-0"))
                while not server.bodies:  # the request reached the server
                    await asyncio.sleep(0.01)
                row.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await row
            finally:
                await client.close()
        return client

    client = asyncio.run(scenario())
    assert [s.outstanding for s in client.router.servers] == [0]


def test_each_server_gets_at_most_max_requests_per_server_at_once():
    per_server, rows = 3, 60

    async def scenario() -> tuple[list[SampleResult], list[ScriptedServer]]:
        async def briefly(body: dict[str, Any]) -> web.Response:
            await asyncio.sleep(0.002)
            return web.json_response(completion())

        async with serving(briefly) as first, serving(briefly) as second:
            client = make_client(first.url, second.url, max_requests_per_server=per_server)
            await client.open()
            try:
                calls = [client.generate(REQUEST, SAMPLED) for _ in range(rows)]
                results = await asyncio.gather(*calls)
            finally:
                await client.close()
        return results, [first, second]

    results, servers = asyncio.run(scenario())
    assert results == [GENERATED] * rows
    assert [len(s.bodies) for s in servers] == [rows // 2] * 2  # the rest waited in the client
    assert max(s.peak for s in servers) <= per_server


def group_answer(n: int) -> Answer:
    """llama-server's answer to a request for ``n`` completions: completion ``j`` gives the
    tokens ``[10 + j, 2]``."""

    async def answer(body: dict[str, Any]) -> web.Response:
        answers = [
            {**completion([10 + j + body["seed"] - REQUEST.seed, 2], [0.5, 1.0]), "index": j}
            for j in range(body.get("n_cmpl", 1))
        ]
        return web.json_response(answers if len(answers) > 1 else answers[0])

    return answer


def run_rows(
    send: Callable[[ServerClient, list[str]], Awaitable[list[SampleResult]]], n: int,
    parallel: int, *script: Answer,
) -> tuple[list[SampleResult], ServerClient, ScriptedServer]:  # fmt: skip
    """``send(client, keys)`` for ``n`` rows against a server answering with ``script`` and
    taking ``parallel`` rows per request."""

    async def scenario() -> tuple[list[SampleResult], ServerClient, ScriptedServer]:
        async with serving(*script) as server:
            client = make_client(server.url)
            client.router.servers[0].parallel = parallel
            await client.open()
            try:
                return await send(client, [f"sample-{j}" for j in range(n)]), client, server
            finally:
                await client.close()

    return asyncio.run(scenario())


def run_group(
    n: int, parallel: int, *script: Answer
) -> tuple[list[SampleResult], ServerClient, ScriptedServer]:
    """``n`` rows of :data:`REQUEST` as one group (:func:`run_rows`)."""
    return run_rows(
        lambda client, keys: client.generate_group(REQUEST, n, SAMPLED, keys), n, parallel,
        *script,
    )  # fmt: skip


def row_result(j: int) -> SampleResult:
    return SampleResult([10 + j, 2], [math.log(0.5), 0.0], truncated=False, versions=[0, 0])


def test_a_group_of_rows_goes_as_one_request_for_as_many_completions():
    results, client, server = run_group(3, 4, group_answer(3))
    assert results == [row_result(j) for j in range(3)]
    assert client.counts == counts(requests=1, retries=0)
    assert server.bodies == [LlamaCppDialect().group_body(REQUEST, 3, SAMPLED)]


def test_a_group_larger_than_the_servers_slots_is_split_keeping_each_rows_seed():
    results, client, server = run_group(5, 2, group_answer(2))
    assert results == [row_result(j) for j in range(5)]
    sent = sorted((body["seed"], body.get("n_cmpl", 1)) for body in server.bodies)
    assert sent == [(5, 2), (7, 1), (8, 2)]  # halves: 2 + 3, then 1 + 2
    assert client.counts["requests"] == 3


def test_a_group_retries_together_and_fails_together():
    results, client, _ = run_group(2, 2, unavailable, group_answer(2))
    assert results == [row_result(0), row_result(1)]
    assert client.counts == counts(requests=2, retries=1)
    results, client, _ = run_group(2, 2, too_long)
    assert [r.tokens for r in results] == [[], []]
    assert all("rejected the request: HTTP 400" in str(r.error) for r in results)
    # rejected: sent again as one request per row, each rejected too
    assert client.counts == counts(requests=3, retries=0, failed_rows=2)


def test_a_group_rejected_by_a_server_now_with_fewer_slots_is_sent_in_halves():
    async def two_slots(body: dict[str, Any]) -> web.Response:  # restarted with 2 of 4
        if body.get("n_cmpl", 1) > 2:
            return web.json_response({"error": {"code": 400, "message": "n_cmpl"}}, status=400)
        return await group_answer(2)(body)

    results, client, server = run_group(4, 4, two_slots)
    assert results == [row_result(j) for j in range(4)]
    assert (server.bodies[0]["seed"], server.bodies[0]["n_cmpl"]) == (5, 4)
    assert sorted((b["seed"], b["n_cmpl"]) for b in server.bodies[1:]) == [(5, 2), (7, 2)]
    assert client.counts == counts(requests=3, retries=0)


def test_a_group_answer_with_too_few_completions_is_retried():
    results, client, _ = run_group(2, 2, answer_ok, group_answer(2))
    assert results == [row_result(0), row_result(1)]
    assert client.counts == counts(requests=2, retries=1)


async def list_answer(body: dict[str, Any]) -> web.Response:
    """llama-server's answer to a request listing prompts: prompt ``j`` (its first token
    ``p``) gives the tokens ``[p, 2]``."""
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    answers = [
        {**completion([prompt[0], 2], [0.5, 1.0]), "index": j} for j, prompt in enumerate(prompts)
    ]
    return web.json_response(answers if len(answers) > 1 else answers[0])


def run_batch(
    n: int, parallel: int, *script: Answer
) -> tuple[list[SampleResult], ServerClient, ScriptedServer]:
    """``n`` unseeded rows of prompts ``[40 + j, 1]`` as one list (:func:`run_rows`)."""
    requests = [GenerationRequest([40 + j, 1], 12, None, None) for j in range(n)]
    return run_rows(
        lambda client, keys: client.generate_batch(requests, SAMPLED, keys), n, parallel,
        *script,
    )  # fmt: skip


def listed_result(j: int) -> SampleResult:
    return SampleResult([40 + j, 2], [math.log(0.5), 0.0], truncated=False, versions=[0, 0])


def test_rows_of_several_prompts_go_as_one_request_listing_them():
    results, client, server = run_batch(3, 4, list_answer)
    assert results == [listed_result(j) for j in range(3)]
    assert client.counts == counts(requests=1, retries=0)
    assert [body["prompt"] for body in server.bodies] == [[[40, 1], [41, 1], [42, 1]]]
    assert server.bodies[0]["seed"] == 0xFFFFFFFF  # unseeded: llama.cpp draws one per prompt


def test_a_list_longer_than_the_servers_slots_is_split_in_halves():
    results, _, server = run_batch(5, 2, list_answer)
    assert results == [listed_result(j) for j in range(5)]
    sent = sorted(tuple(p[0] for p in body["prompt"]) if isinstance(body["prompt"][0], list)
                  else (body["prompt"][0],) for body in server.bodies)  # fmt: skip
    assert sent == [(40, 41), (42,), (43, 44)]  # halves: 2 + 3, then 1 + 2


async def rejects_prompt_42(body: dict[str, Any]) -> web.Response:
    """:func:`list_answer`, except that a request holding the prompt ``[42, 1]`` is
    rejected (HTTP 400, as llama-server rejects a prompt longer than its context)."""
    prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
    if [42, 1] in prompts:
        return web.json_response({"error": {"code": 400, "message": "too long"}}, status=400)
    return await list_answer(body)


def test_a_rejected_list_is_sent_again_in_halves_and_fails_only_the_rejected_prompt():
    results, client, _ = run_batch(4, 4, rejects_prompt_42)
    assert [r.tokens for r in results] == [[40, 2], [41, 2], [], [43, 2]]
    assert "rejected the request: HTTP 400" in str(results[2].error)
    assert [r.error for r in (results[0], results[1], results[3])] == [None] * 3
    # 4 rows, then halves of 2 (one rejected), then that half's rows one each
    assert client.counts == counts(requests=5, retries=0, failed_rows=1)
