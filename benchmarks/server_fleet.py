"""``ServerGeneration`` over a fleet of servers under many requests in flight (issue 27,
point 3): the client's CPU time per request at 1k / 4k / 16k in flight, and what a server
killed and restarted under load costs.

``client``: two stand-in llama.cpp servers (``_http_echo.py``, separate processes, each
answering every ``POST /completion`` with a 16-token reply per completion after a latency
that keeps the requests open together: ``in_flight / 1000`` s, and listing
``--slots`` slots in ``GET /props``) behind one ``ServerClient`` whose
``max_concurrent_requests`` is the load; ``in_flight`` rows go at once, each parsed into
tokens and log-probabilities as in a real run, in two shapes side by side: every row a
different prompt (one request per row), and the rows as samples of prompts, ``--group``
samples each (consecutive seeds), which the client sends as one request for that many
completions (``ServerClient.generate_group``; the servers' slots allow it, read from
``/props`` as at start-up); and each row a prompt of its own again, with at most
``KEPT_OPEN`` requests open at each server (``max_requests_per_server``), so that
connections are reused instead of one opened per row. "client CPU" is this process's CPU time
(``time.process_time``) over the rows, and the cyclic garbage collector's share of it is
measured apart (``gc.callbacks``); the process-wide GC settings are left as they are.

``recovery``: two real llama-servers (the bundled policy as an f32 GGUF,
``tests/fixtures/llama_server.py``: 4 slots, 1 thread each) behind one ``ServerGeneration``
(``max_concurrent_requests`` = ``--requests``, at most 64 sent to each server at once, the
rest waiting in the client; 2 new tokens per request, 3 retries);
``--requests`` rows go at once. Once both servers have answered 32 rows, the second
is killed by process id (SIGKILL), and started again on its port 1 s later (the rows share
one prompt: they go as requests of 4 completions, the servers' slots). Reported:
whether every row ended (with its tokens, or a generation error after its retries), the
retries, the client CPU per request, and the recovery time: from the restarted server
answering ``/health`` to its first answered generation request (the rest of its
set-aside), and from the kill to then.

    .venv/bin/python benchmarks/server_fleet.py [all|client|recovery] [--requests N]
        [--loads 1024,4096,16384] [--group 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _http_echo import echo_server, raise_open_files_limit
from _workloads import GcTimer, load_avg

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.server_client import ServerClient
from envloop.models.generation.server_dialects import GenerationRequest, Sampling, make_dialect
from envloop.models.generation.server_generation import (
    ServerGeneration,
    ServerGenerationConfig,
)
from tests.fixtures.llama_server import LlamaServer, converted_gguf

POLICY = "bundled:policy"
REPLY_TOKENS = 16
SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=None, greedy=False)
PROMPT = list(range(100, 132))
LOADS = [1024, 4096, 16384]
REPEATS = 3
"""Runs of each client measurement (the median's CPU is reported); one-row-per-request runs
past 4,096 in flight run once (about 80 s each here)."""
PER_SERVER = 64
KEPT_OPEN = 128
"""``max_requests_per_server`` of the client section's kept-alive shape: each row a prompt
of its own, at most this many open at each stand-in server (answering after
:data:`KEPT_LATENCY`), so that connections are kept alive and reused."""
KEPT_LATENCY = 0.05
"""``max_requests_per_server`` of the recovery run: llama-server starts a thread per open
connection, and with 8,192 open each it answered nothing in 5 minutes on this machine."""


@dataclass
class ClientRun:
    in_flight: int
    cpu_s: float
    gc_s: float
    wall_s: float
    failed: int
    requests: int


def prompts_for(in_flight: int, group: int) -> list[list[int]]:
    """One prompt per ``group`` rows: :data:`PROMPT` shifted by the prompt's number, within
    the bundled policy's vocabulary."""
    return [[(p + g) % 400 for p in PROMPT] for g in range(0, in_flight, group)]


async def send_at_once(
    urls: list[str], in_flight: int, group: int = 1, listed: bool = False,
    per_server: int | None = None,
) -> ClientRun:  # fmt: skip
    """``in_flight`` rows at once: with ``group`` 1 each a prompt of its own (one request
    each), else samples of prompts, ``group`` each, sent as one request per prompt; or,
    ``listed``, each row a prompt of its own, unseeded, ``group`` prompts per request;
    ``per_server``: ``max_requests_per_server`` (None: every request open at once)."""
    config = ServerGenerationConfig(
        base_urls=urls, dialect="llamacpp", tokenizer=POLICY, max_concurrent_requests=in_flight,
        max_requests_per_server=per_server,
    )  # fmt: skip
    client = ServerClient(config, make_dialect("llamacpp"), vocab_size=1 << 16)
    await client.open()
    for server in client.router.servers:  # what start-up asks: the slots in /props
        await client.start(server, vision=False)
    prompts = prompts_for(in_flight, 1 if listed else group)
    if listed:
        requests = [GenerationRequest(prompt, REPLY_TOKENS, None, None) for prompt in prompts]
        calls = [
            client.generate_batch(requests[g : g + group], SAMPLING, range(g, g + group))
            for g in range(0, in_flight, group)
        ]
    elif group == 1:
        calls = [
            client.generate(GenerationRequest(prompt, REPLY_TOKENS, None, n), SAMPLING, key=n)
            for n, prompt in enumerate(prompts)
        ]
    else:
        calls = [
            client.generate_group(
                GenerationRequest(prompt, REPLY_TOKENS, None, g * group), group, SAMPLING,
                range(g * group, (g + 1) * group),
            )
            for g, prompt in enumerate(prompts)
        ]  # fmt: skip
    gc.collect()
    with GcTimer() as collector:
        cpu, wall = time.process_time(), time.perf_counter()
        answers = await asyncio.gather(*calls)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await client.close()
    results = answers if group == 1 and not listed else [r for rows in answers for r in rows]
    failed = sum(r.error is not None or len(r.tokens) != REPLY_TOKENS for r in results)
    requests = client.counts["requests"]
    return ClientRun(len(results), cpu, collector.seconds, wall, failed, requests)


def generate_at_once(
    urls: list[str], in_flight: int, group: int, listed: bool = False
) -> ClientRun:
    """``in_flight`` rows, samples of prompts ``group`` each, through
    ``ServerGeneration.generate`` (one call: input tensors in, output tensors out); or,
    ``listed``, each row a prompt of its own with ``seed: null`` (the backend lists up to
    the servers' slots, ``group``, prompts per request)."""
    backend = ServerGeneration(
        {"base_urls": urls, "dialect": "llamacpp", "tokenizer": POLICY,
         "max_new_tokens": REPLY_TOKENS, "max_concurrent_requests": in_flight,
         "seed": None if listed else 0}
    )  # fmt: skip
    if listed:
        rows = prompts_for(in_flight, 1)
    else:
        rows = [prompt for prompt in prompts_for(in_flight, group) for _ in range(group)]
    batch = BatchedDataDict(
        input_ids=torch.tensor(rows), input_lengths=torch.tensor([len(PROMPT)] * len(rows))
    )
    try:
        gc.collect()
        with GcTimer() as collector:
            cpu, wall = time.process_time(), time.perf_counter()
            out = backend.generate(batch)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        requests = backend.request_stats()["requests"]
    finally:
        backend.shutdown()
    lengths = out["generation_lengths"].tolist()
    failed = sum(
        e is not None or n != REPLY_TOKENS for e, n in zip(out["generation_error"], lengths)
    )
    return ClientRun(len(rows), cpu, collector.seconds, wall, failed, requests)


def shapes(group: int) -> list[tuple[str, int, bool]]:
    """The client section's shapes: (through, rows per request, prompts listed)."""
    return [("client", 1, False), ("client", group, False), ("backend", group, False),
            ("client", group, True), ("backend", group, True)]  # fmt: skip


def client_section(loads: list[int], group: int) -> list[str]:
    lines = [
        "Client CPU per row: one `ServerClient` over two stand-in llama.cpp servers "
        f"(other processes, {group} slots each), `in_flight` rows sent at once, "
        f"{len(PROMPT)}-token prompts, {REPLY_TOKENS} tokens back per row, server latency "
        f"in_flight / 1000 s; each row a prompt of its own (one request per row), "
        f"samples of prompts, {group} each (one request per prompt), or each row a prompt "
        f"of its own, unseeded, {group} prompts listed per request, through `ServerClient` "
        "and through `ServerGeneration.generate` (tensors in and out, the client's thread "
        f"included); the median CPU of {REPEATS} runs (one run for one row per request "
        f"past 4,096). Last at each load: each row a prompt of its own, at most {KEPT_OPEN} "
        f"requests open at each server (`max_requests_per_server`; servers answering after "
        f"{KEPT_LATENCY:g} s), so that connections are reused, median of {REPEATS}.",
        "",
        "| in flight (rows) | through | rows per request | HTTP requests | client CPU µs/row "
        "| of which cyclic GC | without GC | wall s | failed | load before |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for in_flight in loads:
        latency = max(0.1, in_flight / 1000)
        with echo_server(latency, group) as first, echo_server(latency, group) as second:
            asyncio.run(send_at_once([first, second], 64))  # warm-up
            for through, per_request, listed in shapes(group):
                load = load_avg().split()[0]
                repeats = 1 if per_request == 1 and in_flight > 4096 else REPEATS
                runs = []
                for _ in range(repeats):
                    if through == "client":
                        runs.append(
                            asyncio.run(
                                send_at_once([first, second], in_flight, per_request, listed)
                            )
                        )
                    else:
                        runs.append(
                            generate_at_once([first, second], in_flight, per_request, listed)
                        )
                run = sorted(runs, key=lambda r: r.cpu_s)[len(runs) // 2]
                us = 1e6 / run.in_flight
                name = "`ServerClient`" if through == "client" else "`ServerGeneration`"
                rows = "prompts listed" if listed else "samples of a prompt"
                lines.append(
                    f"| {in_flight:,} | {name} | {per_request} "
                    f"{rows if per_request > 1 else 'prompt'} | {run.requests:,} "
                    f"| {run.cpu_s * us:,.0f} | {run.gc_s * us:,.0f} "
                    f"| {(run.cpu_s - run.gc_s) * us:,.0f} | {run.wall_s:.1f} | {run.failed} "
                    f"| {load} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)  # progress
        with echo_server(KEPT_LATENCY, group) as first, echo_server(KEPT_LATENCY, group) as second:
            load = load_avg().split()[0]
            runs = [
                asyncio.run(send_at_once([first, second], in_flight, per_server=KEPT_OPEN))
                for _ in range(REPEATS)
            ]
            run = sorted(runs, key=lambda r: r.cpu_s)[len(runs) // 2]
            us = 1e6 / run.in_flight
            lines.append(
                f"| {in_flight:,} | `ServerClient`, at most {KEPT_OPEN} open per server "
                f"| 1 prompt | {run.requests:,} | {run.cpu_s * us:,.0f} | {run.gc_s * us:,.0f} "
                f"| {(run.cpu_s - run.gc_s) * us:,.0f} | {run.wall_s:.1f} | {run.failed} "
                f"| {load} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def recovery_section(requests: int) -> list[str]:
    gguf = converted_gguf(Path(resolve_model(POLICY)))
    first, second = LlamaServer(gguf).start(), LlamaServer(gguf).start()
    backend = ServerGeneration(
        {"base_urls": [first.url, second.url], "dialect": "llamacpp", "tokenizer": POLICY,
         "max_new_tokens": 2, "max_concurrent_requests": requests, "max_retries": 3,
         "retry_backoff_s": 0.2, "max_requests_per_server": PER_SERVER}
    )  # fmt: skip
    times: dict[str, float] = {}

    def answered(url: str) -> int:
        return int(backend.request_stats()["answered"][url])

    def kill_and_restart() -> None:
        while min(backend.request_stats()["answered"].values()) < 32:
            time.sleep(0.05)
        assert second.process is not None
        os.kill(second.process.pid, signal.SIGKILL)
        second.process.wait()
        times["killed"] = time.perf_counter()
        before = answered(second.url)
        time.sleep(1.0)
        second.start()
        times["up"] = time.perf_counter()
        while answered(second.url) == before and "done" not in times:
            time.sleep(0.01)
        times["serving"] = time.perf_counter()

    try:
        ids = backend.tokenizer("Count to ten:", add_special_tokens=False).input_ids
        batch = BatchedDataDict(
            input_ids=torch.tensor([ids] * requests),
            input_lengths=torch.tensor([len(ids)] * requests),
        )
        chaos = threading.Thread(target=kill_and_restart)
        chaos.start()
        cpu, wall = time.process_time(), time.perf_counter()
        out = backend.generate(batch)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        times["done"] = time.perf_counter()
        chaos.join()
        stats = backend.request_stats()
    finally:
        backend.shutdown()
        first.stop()
        second.stop()
    errors = out["generation_error"]
    ok = sum(e is None and n > 0 for e, n in zip(errors, out["generation_lengths"].tolist()))
    failed = sum(e is not None for e in errors)
    back = "serving" in times and times["serving"] < times["done"]
    recovery = (
        f"{times['serving'] - times['up']:.2f} s after it answered /health, "
        f"{times['serving'] - times['killed']:.2f} s after the kill"
        if back
        else "not before the last row ended"
    )
    return [
        f"Server killed under load: {requests:,} rows at once over two llama-servers, "
        "the second killed by pid once both answered 32 rows and restarted 1 s later.",
        "",
        f"- rows: {len(errors):,}; with their tokens: {ok:,}; generation errors after "
        f"their retries: {failed:,}; lost: {requests - ok - failed}",
        f"- HTTP requests {stats['requests']:,}, retries {stats['retries']:,}, answered "
        f"per server {list(stats['answered'].values())}",
        f"- wall {wall:.1f} s; client CPU {cpu / requests * 1e6:,.0f} µs/row",
        f"- the restarted server answered its first request {recovery}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("section", nargs="?", default="all", choices=["all", "client", "recovery"])
    parser.add_argument("--requests", type=int, default=16384, help="recovery: rows at once")
    parser.add_argument(
        "--loads", default=",".join(map(str, LOADS)), help="client: rows in flight, comma-separated"
    )
    parser.add_argument("--group", type=int, default=16, help="client: samples per prompt")
    args = parser.parse_args()
    raise_open_files_limit()
    command = " ".join(["benchmarks/server_fleet.py", *sys.argv[1:]])
    print(f"`.venv/bin/python {command}` ({os.cpu_count()} cores; load average before: "
          f"{load_avg()})\n", flush=True)  # fmt: skip
    if args.section in ("all", "client"):
        loads = [int(load) for load in args.loads.split(",")]
        print("\n".join(client_section(loads, args.group)) + "\n", flush=True)
    if args.section in ("all", "recovery"):
        print("\n".join(recovery_section(args.requests)) + "\n", flush=True)
    print(f"(load average after: {load_avg()})")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
