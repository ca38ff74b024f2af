"""ServerGeneration.update_weights against HTTP servers on 127.0.0.1 that answer with the
recorded shapes of vLLM's and SGLang's endpoints.

vLLM and SGLang do not run on this machine (they need a GPU), so these servers are stand-ins:
they check the exact method, path and JSON body of each weight-update request we send, in
order, and answer as each server's source does (routes and request models cited in
``VllmDialect`` and ``SglangDialect``): vLLM's ``/pause`` ``{"status": "paused"}``,
``/collective_rpc`` ``{"results": [null]}`` (one worker; FastAPI's plain 500 when a worker
raised, 404 ``{"detail": "Not Found"}`` without ``VLLM_SERVER_DEV_MODE=1``), ``/resume``
``{"status": "resumed"}``; SGLang's ``/update_weights_from_disk`` ``{"success", "message",
"num_paused_requests"}`` (HTTP 400 with ``"success": false``). Generation answers follow
``server_dialects/test_*_dialect.py`` (SGLang's answer to a request listing prompts: a list
of their answers, in order). They test our requests and version bookkeeping, and the rows
we list in one SGLang request, not the servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.loop_thread import LoopThread
from envloop.models.generation.server_dialects import (
    GenerationRequest,
    LlamaCppDialect,
    Sampling,
    SglangDialect,
)
from envloop.models.generation.server_generation import ServerGeneration, WeightUpdateFailed

CHECKPOINT = "/checkpoints/step-100"
TOKENS = [120, 121, 2]
"""Every reply's tokens (2 is the tiny tokenizer's EOS)."""
LOGPROBS = [-0.25, -1.5, -0.0625]
PROMPTS = [[10, 11, 12], [13, 14]]
GREEDY_OFF = Sampling(temperature=1.0, top_p=1.0, top_k=None, greedy=False)
"""ServerGeneration's default sampling."""
Answer = Callable[[Any], tuple[int, Any]]
"""A weight-update endpoint's answer to a request body: (HTTP status, JSON or plain text)."""


def sglang_reloaded(body: Any) -> tuple[int, Any]:
    """SGLang's answer when the reload succeeded (the message names the version label)."""
    message = "Succeeded to update model weights."
    if body.get("weight_version") is not None:
        message += f" Weight version updated to {body['weight_version']}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


SGLANG_FAILED = {
    "success": False,
    "message": "Failed to get weights iterator: /checkpoints/step-100 (no such directory).",
    "num_paused_requests": 0,
}
RECORDED: dict[str, dict[str, Answer]] = {
    "vllm": {
        "/pause": lambda body: (200, {"status": "paused"}),
        "/collective_rpc": lambda body: (200, {"results": [None]}),
        "/resume": lambda body: (200, {"status": "resumed"}),
    },
    "sglang": {"/update_weights_from_disk": sglang_reloaded},
    "llamacpp": {},
}
NOT_FOUND: Answer = lambda body: (404, {"detail": "Not Found"})  # noqa: E731


def generation_answer(dialect: str, body: dict[str, Any]) -> Any:
    """Each server's answer (the shape of server_dialects/test_*_dialect.py's) generating
    ``TOKENS``."""
    if dialect == "vllm":
        names = [f"token_id:{t}" for t in TOKENS]
        logprobs = {"tokens": names, "token_logprobs": LOGPROBS, "text_offset": [0, 13, 26],
                    "top_logprobs": [{n: lp} for n, lp in zip(names, LOGPROBS)]}  # fmt: skip
        choice = {"index": 0, "text": "ab", "logprobs": logprobs, "finish_reason": "stop",
                  "stop_reason": None, "token_ids": TOKENS}  # fmt: skip
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(TOKENS)}
        return {"id": "cmpl-1", "object": "text_completion", "model": "m",
                "choices": [choice], "usage": usage}  # fmt: skip
    if dialect == "sglang":
        if body["input_ids"] and isinstance(body["input_ids"][0], list):  # prompts listed
            return [generation_answer(dialect, {"input_ids": ids}) for ids in body["input_ids"]]
        entries = [[lp, t, None] for t, lp in zip(TOKENS, LOGPROBS)]
        meta = {"finish_reason": {"type": "stop", "matched": 2}, "weight_version": "default",
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(TOKENS),
                "output_token_logprobs": entries}  # fmt: skip
        return {"text": "ab", "output_ids": TOKENS, "meta_info": meta}
    entries = [{"id": t, "prob": math.exp(lp)} for t, lp in zip(TOKENS, LOGPROBS)]
    return {"tokens": TOKENS, "completion_probabilities": entries, "stop_type": "eos",
            "tokens_evaluated": len(body["prompt"])}  # fmt: skip


GENERATION_PATH = {"vllm": "/v1/completions", "sglang": "/generate", "llamacpp": "/completion"}


class RecordedServer:
    """A stand-in server of ``dialect`` on 127.0.0.1, on its own thread and event loop.

    ``requests`` records each weight-update request as ``(method, path with query, JSON
    body or None)``, ``generations`` each generation request's body; ``log`` records the
    weight-update requests as ``"POST /path"`` and each generation request as
    ``"generate"`` when it arrives and ``"answered"`` when it is answered. :meth:`hold`
    keeps generation answers back until :meth:`release`; ``fail_next_generation`` answers
    the next one with a 503 instead.
    """

    def __init__(self, dialect: str, **answers: Answer) -> None:
        self.dialect = dialect
        self.answers = {**RECORDED[dialect], **answers}
        self.requests: list[tuple[str, str, Any]] = []
        self.generations: list[Any] = []
        self.log: list[str] = []
        self.generation_arrived = threading.Event()
        self.fail_next_generation = False
        self._thread = LoopThread("recorded-server")
        self._loop = self._thread.loop
        self._released = self._run(self._event())
        self._runner: web.AppRunner | None = None
        self.url = self._run(self._start())

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._released.clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._released.set)

    def stop(self) -> None:
        self.release()
        if self._runner is not None:
            self._run(self._runner.cleanup())
        self._thread.close(wait=True)

    def _run(self, call: Any) -> Any:
        return self._thread.submit(call).result(timeout=10)

    async def _event(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    async def _handle(self, request: web.Request) -> web.Response:
        text = await request.text()
        body = json.loads(text) if text else None
        if request.path == GENERATION_PATH[self.dialect]:
            return await self._generate(body)
        self.requests.append((request.method, request.path_qs, body))
        self.log.append(f"{request.method} {request.path_qs}")
        status, payload = self.answers.get(request.path, NOT_FOUND)(body)
        if isinstance(payload, str):
            return web.Response(status=status, text=payload)
        return web.json_response(payload, status=status)

    async def _generate(self, body: dict[str, Any]) -> web.Response:
        self.log.append("generate")
        self.generations.append(body)
        self.generation_arrived.set()
        await self._released.wait()
        self.log.append("answered")
        if self.fail_next_generation:
            self.fail_next_generation = False
            return web.Response(status=503, text="Service Unavailable")
        return web.json_response(generation_answer(self.dialect, body))


@contextlib.contextmanager
def serving(dialect: str, *answers: dict[str, Answer]) -> Iterator[list[RecordedServer]]:
    """One :class:`RecordedServer` per entry of ``answers`` (its overrides)."""
    servers = [RecordedServer(dialect, **overrides) for overrides in answers]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextlib.contextmanager
def policy_on(servers: list[RecordedServer], tokenizer: Path) -> Iterator[ServerGeneration]:
    """A ServerGeneration of ``servers``' dialect, its start-up probes already answered."""
    config = {"base_urls": [s.url for s in servers], "dialect": servers[0].dialect,
              "tokenizer": str(tokenizer), "model": "m", "max_new_tokens": 8,
              "retry_backoff_s": 0.01, "request_timeout_s": 10,
              "startup_timeout_s": 10}  # fmt: skip
    policy = ServerGeneration(config)
    for server in servers:  # forget the probe requests
        server.log.clear()
        server.generations.clear()
        server.generation_arrived.clear()
    try:
        yield policy
    finally:
        policy.shutdown()


def batch() -> BatchedDataDict:
    ids = torch.tensor([p + [0] * (3 - len(p)) for p in PROMPTS])
    return BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([3, 2]))


def expected_versions(version: int) -> torch.Tensor:
    """``policy_versions`` of :func:`batch`'s output: ``version`` at the generated tokens."""
    v = version
    return torch.tensor([[0, 0, 0, v, v, v], [0, 0, v, v, v, 0]], dtype=torch.int32)


VLLM_RELOAD = [
    ("POST", "/pause?mode=wait", None),
    ("POST", "/collective_rpc",
     {"method": "reload_weights", "kwargs": {"weights_path": CHECKPOINT}}),
    ("POST", "/resume", None),
]  # fmt: skip


def sglang_reload(version: int) -> list[tuple[str, str, Any]]:
    body = {"model_path": CHECKPOINT, "abort_all_requests": False, "weight_version": str(version)}
    return [("POST", "/update_weights_from_disk", body)]


def test_vllm_pauses_reloads_and_resumes_every_server_in_order(tiny_policy_dir):
    with serving("vllm", {}, {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        assert policy.model == "m"  # the config's: no /v1/models request
        assert policy.update_weights(Path(CHECKPOINT)) == 1
        assert [server.requests for server in servers] == [VLLM_RELOAD, VLLM_RELOAD]


def test_sglang_reloads_every_server_with_the_version_as_its_label(tiny_policy_dir):
    with serving("sglang", {}, {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        assert policy.update_weights(CHECKPOINT) == 1
        assert [server.requests for server in servers] == [sglang_reload(1)] * 2


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_versions_go_0_1_then_explicit_and_label_the_tokens_generated_after(
    dialect, tiny_policy_dir
):
    with serving(dialect, {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        assert policy.policy_version == 0
        assert torch.equal(policy.generate(batch())["policy_versions"], expected_versions(0))
        assert policy.update_weights(CHECKPOINT) == 1
        assert policy.policy_version == 1
        assert torch.equal(policy.generate(batch())["policy_versions"], expected_versions(1))
        assert policy.update_weights(CHECKPOINT, version=5) == 5
        assert policy.policy_version == 5
        assert torch.equal(policy.generate(batch())["policy_versions"], expected_versions(5))
        if dialect == "sglang":
            assert servers[0].requests == sglang_reload(1) + sglang_reload(5)


def test_a_server_joining_after_an_update_reloads_that_checkpoint_first(tiny_policy_dir):
    with serving("sglang", {}, {}) as (up, late):
        late.hold()  # its probe request gets no answer: it starts outside the routing
        config = {"base_urls": [up.url, late.url], "dialect": "sglang", "max_new_tokens": 8,
                  "tokenizer": str(tiny_policy_dir), "startup_timeout_s": 0.5}  # fmt: skip
        with pytest.warns(UserWarning, match=f"{late.url} \\(no answer within 0.5 s\\)"):
            policy = ServerGeneration(config)
        try:
            assert policy.request_stats()["joined"] == [up.url]
            assert policy.update_weights(CHECKPOINT) == 1
            assert (up.requests, late.requests) == (sglang_reload(1), [])
            late.release()
            deadline = time.monotonic() + 30
            while late.url not in policy.request_stats()["joined"]:
                assert time.monotonic() < deadline, "the late server joined within 30 s"
                time.sleep(0.05)
            assert late.requests == sglang_reload(1)  # before it took any request
            rows = batch()  # other stop strings: two requests, not one listing both rows
            rows["stop_strings"] = [["</a>"], None]
            out = policy.generate(rows)  # one row on each server
            assert torch.equal(out["policy_versions"], expected_versions(1))
            assert policy.request_stats()["answered"] == {up.url: 1, late.url: 1}
        finally:
            policy.shutdown()


FAILURES = {
    "vllm": (
        {"/collective_rpc": lambda body: (500, "Internal Server Error")},
        "POST /collective_rpc: HTTP 500: Internal Server Error",
        "vLLM serves /pause, /resume and /collective_rpc only when started with "
        "VLLM_SERVER_DEV_MODE=1, and its workers' reload_weights must take weights_path "
        "(a recent vLLM); the checkpoint must be a folder the server can read, with the "
        "served model's architecture",
    ),
    "sglang": (
        {"/update_weights_from_disk": lambda body: (400, SGLANG_FAILED)},
        f"POST /update_weights_from_disk: HTTP 400: {json.dumps(SGLANG_FAILED)}",
        "SGLang reads model_path on the server's machine: a model folder with the served "
        "model's architecture and sizes",
    ),
}


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_a_failing_server_is_listed_and_the_version_stays(dialect, tiny_policy_dir):
    failing, error, needs = FAILURES[dialect]
    with serving(dialect, {}, failing) as servers, policy_on(servers, tiny_policy_dir) as policy:
        good, bad = servers
        with pytest.raises(WeightUpdateFailed) as raised:
            policy.update_weights(CHECKPOINT)
        assert str(raised.value) == (
            f"update_weights('{CHECKPOINT}') failed on 1 of 2 server(s); the policy version "
            f"stays 0:\n  - {bad.url}: {error}\n  {good.url} reloaded and already serve the "
            "new weights; call update_weights again with this checkpoint once the others "
            f"are fixed.\n  Check: {needs}."
        )
        expected = VLLM_RELOAD if dialect == "vllm" else sglang_reload(1)
        assert good.requests == bad.requests == expected  # the failed one resumed too
        assert policy.policy_version == 0
        assert torch.equal(policy.generate(batch())["policy_versions"], expected_versions(0))
        bad.answers = dict(RECORDED[dialect])
        assert policy.update_weights(CHECKPOINT) == 1


def test_vllm_without_dev_mode_fails_at_the_pause_and_is_not_reloaded(tiny_policy_dir):
    no_dev_mode = {"/pause": NOT_FOUND, "/collective_rpc": NOT_FOUND, "/resume": NOT_FOUND}
    with serving("vllm", no_dev_mode) as servers, policy_on(servers, tiny_policy_dir) as policy:
        with pytest.raises(WeightUpdateFailed, match="VLLM_SERVER_DEV_MODE=1") as raised:
            policy.update_weights(CHECKPOINT)
        not_found = 'HTTP 404: {"detail": "Not Found"}'
        assert f"POST /pause?mode=wait: {not_found}; POST /resume: {not_found}" in str(raised.value)
        assert servers[0].requests == [VLLM_RELOAD[0], VLLM_RELOAD[2]]
        assert policy.policy_version == 0


@pytest.mark.parametrize(
    "first_answer, version", [("ok", 0), ("503", 1)], ids=["answered", "retried"]
)
def test_requests_sent_before_the_update_are_answered_before_the_reload(
    first_answer, version, tiny_policy_dir
):
    """A request in flight when the update starts is answered before the server is paused
    (its tokens are version 0; a retry of it waits for the update like a new request and
    gets version 1), and a request made during the update waits for the resume."""
    with serving("vllm", {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        server = servers[0]
        server.fail_next_generation = first_answer == "503"
        server.hold()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            before = pool.submit(policy.generate, batch().slice(0, 1))
            assert server.generation_arrived.wait(timeout=10)
            update = pool.submit(policy.update_weights, CHECKPOINT)
            time.sleep(0.3)  # time for a wrong implementation to pause while one is in flight
            during = pool.submit(policy.generate, batch().slice(1, 2))
            time.sleep(0.3)
            assert server.log == ["generate"]
            server.release()
            assert update.result(timeout=10) == 1
            first, second = before.result(timeout=10), during.result(timeout=10)
    assert first["policy_versions"].tolist() == [[0, 0, 0] + [version] * 3]
    assert second["policy_versions"].tolist() == [[0, 0, 1, 1, 1]]
    reload = ["POST /pause?mode=wait", "POST /collective_rpc", "POST /resume"]
    retried = ["generate", "answered"] if first_answer == "503" else []
    assert server.log[:2] == ["generate", "answered"]
    assert server.log[2:5] == reload
    assert sorted(server.log[5:]) == sorted([*retried, "generate", "answered"])


LLAMA_REFUSAL = (
    "llama.cpp's server cannot reload weights; restart llama-server with the new GGUF "
    "(-m <file>; scripts/convert_to_gguf.py converts a checkpoint folder to one) and build "
    "a new ServerGeneration for it"
)


def test_llamacpp_refuses_before_sending_anything(tiny_policy_dir):
    with serving("llamacpp", {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        assert servers[0].requests == [("GET", "/props", None)]  # start-up: its slots
        with pytest.raises(NotImplementedError) as raised:
            policy.update_weights(CHECKPOINT)
        assert str(raised.value) == f"update_weights ({servers[0].url}): {LLAMA_REFUSAL}."
        assert servers[0].log == [] and servers[0].requests == [("GET", "/props", None)]
        assert policy.policy_version == 0
    with pytest.raises(NotImplementedError, match="cannot reload weights"):
        LlamaCppDialect().weight_reload(CHECKPOINT, 1)


@pytest.mark.parametrize(
    "checkpoint, version, error, message",
    [
        ("checkpoints/step-100", None, ValueError,
         "update_weights(checkpoint='checkpoints/step-100'): expected an absolute path, which "
         "each server reads on its own machine (a relative one would be resolved against its "
         "working directory); e.g. os.path.abspath(checkpoint) when the servers share this "
         "machine's files."),
        ({"lm_head.weight": 0}, None, TypeError,
         "update_weights(checkpoint=dict): expected the path (str or os.PathLike) of a "
         "checkpoint the servers can read; ServerGeneration sends servers a path, not "
         "weights: save them first (save_pretrained(folder))."),
        (CHECKPOINT, -1, ValueError,
         "update_weights(version=-1) would move the policy version backwards from 0; give a "
         "version >= 0, or version=None for the next one (1)."),
        (CHECKPOINT, True, TypeError,
         "update_weights(version=True): the version must be an int, or None for the next "
         "one (1)."),
    ],
    ids=["relative", "weights", "backwards", "bool"],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_is_sent(
    checkpoint, version, error, message, tiny_policy_dir
):
    with serving("vllm", {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        with pytest.raises(error) as raised:
            policy.update_weights(checkpoint, version=version)
        assert str(raised.value) == message
        assert servers[0].requests == []
        assert policy.policy_version == 0


def test_sglang_takes_seeded_rows_of_other_prompts_in_one_request_each_with_its_seed(
    tiny_policy_dir,
):
    """SGLang samples each prompt of a list with its own ``sampling_seed``, so a seeded
    batch's rows of other prompts go as one request listing them, each row with the seed
    and budget a request of its own would carry; its rows get their own answers."""
    with serving("sglang", {}) as servers, policy_on(servers, tiny_policy_dir) as policy:
        out = policy.generate(batch())
        alone = [SglangDialect().body(GenerationRequest(p, 8, None, 0), GREEDY_OFF)
                 for p in PROMPTS]  # fmt: skip
        (listed,) = servers[0].generations
    assert listed["input_ids"] == PROMPTS
    seeds = [params.pop("sampling_seed") for params in listed["sampling_params"]]
    assert seeds[1] == seeds[0] + 1  # each row's own seed, as ServerGeneration numbers them
    for params in alone:
        params["sampling_params"].pop("sampling_seed")
    assert listed["sampling_params"] == [body["sampling_params"] for body in alone]
    assert out["generation_lengths"].tolist() == [len(TOKENS)] * 2
