"""A fleet of real llama-servers (the bundled policy as an f32 GGUF) behind one
``ServerGeneration``: start-up with the servers that answer (a dead URL and one that comes
up later), the late one joining the routing without a restart, start-up failing only when
none answers, and a server killed and restarted by process id under 16,384 rows in flight,
with every sample ending (its response, or a generation error after its retries).

Servers are started and killed by process id (``LlamaServer.process``); the waits for a
server to join or to answer are bounded polls, never timing assertions.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.server_generation import ServerGeneration
from tests.fixtures.llama_server import LlamaServer, converted_gguf, free_port

pytestmark = pytest.mark.server
IN_FLIGHT = 16384
"""Rows in flight in the load test, all given at once: samples of one prompt, so they go as
requests of :data:`SLOTS` completions (1,024 requests), at most :data:`PER_SERVER` of them
open at each server, the rest waiting in the client."""
SLOTS = 16
"""Each llama-server's slots in the load test (``--parallel``)."""
PER_SERVER = 64
"""``max_requests_per_server`` of the load test: llama-server starts a thread per open
connection (docs/server_fleets.md)."""
POLL_S = 60.0


@pytest.fixture(scope="module")
def gguf() -> Path:
    return converted_gguf(Path(resolve_model("bundled:policy")))


def fleet(urls: list[str], **settings) -> ServerGeneration:
    config = {"base_urls": urls, "dialect": "llamacpp", "tokenizer": "bundled:policy",
              "max_new_tokens": 4, **settings}  # fmt: skip
    return ServerGeneration(config)


def rows(backend: ServerGeneration, n: int) -> BatchedDataDict:
    """``n`` rows of one short prompt."""
    ids = backend.tokenizer("Count to ten:", add_special_tokens=False).input_ids
    return BatchedDataDict(
        input_ids=torch.tensor([ids] * n), input_lengths=torch.tensor([len(ids)] * n)
    )


def kill(server: LlamaServer) -> None:
    """SIGKILL the server's process by its id, and reap it."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + POLL_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {POLL_S:g} s"
        time.sleep(0.1)


def test_a_fleet_starts_with_the_servers_that_answer_and_the_others_join_when_up(gguf):
    live = LlamaServer(gguf).start()
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    late = LlamaServer(gguf)  # its port is chosen; it starts after the backend
    try:
        with pytest.warns(UserWarning) as caught:
            backend = fleet([live.url, dead, late.url], startup_timeout_s=120)
        try:
            (warning,) = caught
            message = str(warning.message)
            assert message.startswith("Starting with 1 of 3 server(s); not answering yet: ")
            assert f"{dead} (ConnectionRefusedError" in message
            assert f"{late.url} (ConnectionRefusedError" in message
            assert backend.request_stats()["joined"] == [live.url]

            out = backend.generate(rows(backend, 8))
            assert out["generation_error"] == [None] * 8
            assert backend.request_stats()["answered"] == {live.url: 8, dead: 0, late.url: 0}

            late.start()
            wait_until(lambda: late.url in backend.request_stats()["joined"], "late joined")
            assert backend.request_stats()["joined"] == [live.url, late.url]
            out = backend.generate(rows(backend, 16))  # least outstanding: both take rows
            assert out["generation_error"] == [None] * 16
            answered = backend.request_stats()["answered"]
            assert answered[late.url] > 0 and answered[live.url] > 8
            assert answered[dead] == 0 and backend.request_stats()["retries"] == 0
        finally:
            backend.shutdown()
    finally:
        live.stop()
        late.stop()


def test_start_up_fails_only_when_no_server_answers():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with pytest.raises(RuntimeError) as error:
        fleet(dead, startup_timeout_s=0.5)
    lines = str(error.value).splitlines()
    assert lines[0] == "No server answered a llamacpp probe request within startup_timeout_s=0.5 s:"
    for url, line in zip(dead, lines[1:3]):
        assert line.startswith(f"  - {url} did not answer (last: ConnectionRefusedError")
    assert lines[3] == "Start the servers, fix base_urls, or raise startup_timeout_s."


def test_a_server_killed_and_restarted_under_load_loses_no_sample(gguf):
    first, second = LlamaServer(gguf, slots=SLOTS).start(), LlamaServer(gguf, slots=SLOTS).start()
    backend = fleet(
        [first.url, second.url], max_concurrent_requests=IN_FLIGHT, max_retries=3,
        retry_backoff_s=0.2, request_timeout_s=120, max_requests_per_server=PER_SERVER,
        max_new_tokens=2,
    )  # fmt: skip
    killed, restarted = threading.Event(), threading.Event()

    def kill_and_restart() -> None:  # once both servers have answered under load
        stats = backend.request_stats
        wait_until(lambda: min(stats()["answered"].values()) >= 32, "both servers answered")
        kill(second)
        killed.set()
        time.sleep(1.0)  # requests in flight to it fail; new ones are retried elsewhere
        second.start()
        restarted.set()

    chaos = threading.Thread(target=kill_and_restart)
    try:
        chaos.start()
        out = backend.generate(rows(backend, IN_FLIGHT))
        chaos.join()
        assert killed.is_set() and restarted.is_set()
        errors = out["generation_error"]
        assert len(errors) == IN_FLIGHT  # every sample ended, none lost
        lengths = out["generation_lengths"].tolist()
        for error, length in zip(errors, lengths):  # a response, or an error and no tokens
            assert (error is None and length > 0) or (
                error.startswith("generation failed after 4 attempt(s); last: ") and length == 0
            )
        stats = backend.request_stats()
        assert stats["retries"] > 0
        assert stats["failed_rows"] == sum(e is not None for e in errors)
        assert sum(stats["outstanding"].values()) == 0
        # the restarted server takes requests again once its set-aside has passed
        slot = backend._client.router.servers[1]
        time.sleep(max(0.0, slot.down_until - time.monotonic()))
        before = stats["answered"][second.url]
        out = backend.generate(rows(backend, 2 * SLOTS))  # two requests, one per server
        assert out["generation_error"] == [None] * 2 * SLOTS
        assert backend.request_stats()["answered"][second.url] > before
    finally:
        backend.shutdown()
        first.stop()
        second.stop()
