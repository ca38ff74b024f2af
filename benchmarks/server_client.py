"""The HTTP client of ``ServerGeneration`` under many requests in flight, and
``ServerGeneration`` on a real llama-server against ``HfGeneration`` in-process (issue 13).

``client``: the client's CPU time per request as the requests in flight grow from 64 to
4,096 (a published gym's client slowed down quadratically in an aiohttp connection pool at
16k requests). A stand-in llama.cpp server (``_http_echo.py``) runs in a separate process
and answers every ``POST /completion`` with the same 16-token reply after a fixed latency;
the latency grows with the limit (:func:`echo_latency_s`) so that the requests really are
open together at the server, which reports the most it saw open at once. This process
builds a ``ServerClient`` (llama.cpp dialect, ``max_concurrent_requests`` = the limit) and
sends the same number of requests at once for every limit; each reply is parsed into tokens
and log-probabilities as in a real run. "client CPU" is this process's CPU time
(``time.process_time``) over the run divided by the requests, and the cyclic garbage
collector's share of it is measured apart (``gc.callbacks``): the collector rescans the
objects of every open request, so its share grows with the requests open, while the
client's own work should stay flat. Both processes raise their open-files limit to the hard
one; the server's listening backlog is 8,192 (the kernel caps it at
``net.core.somaxconn``).

``throughput``: the bundled policy generating for the 24 demo prompts (every task's,
rendered by the chat template), each repeated to make ``--rows`` rows, at most 48 new
tokens, greedy and sampled (temperature 1), through ``ServerGeneration`` on llama-server
(the policy converted to an f32 GGUF by ``tests/fixtures/llama_server.py``: 4 slots,
``-t 1``, f32 KV cache) and through ``HfGeneration`` in this process (float32, 1 torch
thread, micro-batches of 32 rows); backends alternate, median of the repeats. Both share
the machine's cores (2 here) with each other's idle threads and the HTTP client, which runs
in this process. Sampled outputs differ between the two (different random streams), so
compare tokens/s there; greedy outputs are compared token for token.

    .venv/bin/python benchmarks/server_client.py [all|client|throughput] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import torch
from _http_echo import echo_server, raise_open_files_limit
from _workloads import GcTimer, load_avg
from transformers import AutoTokenizer

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.server_client import RetryableFailure, ServerClient
from envloop.models.generation.server_dialects import GenerationRequest, Sampling, make_dialect
from envloop.models.generation.server_generation import (
    ServerGeneration,
    ServerGenerationConfig,
)
from envloop.models.generation.server_routing import ServerSlot
from tests.fixtures.llama_server import LlamaServer, converted_gguf

POLICY = "bundled:policy"
DEMO_DATA = Path(__file__).resolve().parents[1] / "examples" / "demo_data.jsonl"
MAX_NEW_TOKENS = 48
REPLY_TOKENS = 16  # what the stand-in server sends back
SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=None, greedy=False)
SERVER = "ServerGeneration (llama-server)"


def demo_prompts(tokenizer: Any) -> list[list[int]]:
    """Every demo prompt, rendered by the chat template, as token ids."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for row in rows
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


# --- client cost per request -------------------------------------------------------------


@dataclass
class ClientRun:
    in_flight: int
    requests: int
    cpu_s: float
    gc_s: float
    wall_s: float
    retries: int
    failed: int
    peak_open: int

    def us_per_request(self, seconds: float) -> float:
        return seconds / self.requests * 1e6


def echo_latency_s(in_flight: int) -> float:
    """The stand-in server's latency for a limit: long enough that ``in_flight`` requests
    are open together once the client sends 1,000 requests/s (Little's law); the server's
    peak shows whether they were."""
    return max(0.1, in_flight / 1000)


async def send_all(client: ServerClient, prompt: list[int], requests: int) -> int:
    """Send ``requests`` generation requests at once; returns the rows that failed."""
    calls = [
        client.generate(GenerationRequest(prompt, REPLY_TOKENS, None, seed), SAMPLING, key=seed)
        for seed in range(requests)
    ]
    results = await asyncio.gather(*calls)
    return sum(r.error is not None or len(r.tokens) != REPLY_TOKENS for r in results)


class AiohttpClient(ServerClient):
    """``ServerClient`` with its generation requests sent through one pooled aiohttp
    session (a general-purpose HTTP client, what ``ServerClient`` used before its own
    kept-alive connections), for comparison; the same bounds, retries and parsing."""

    async def open(self) -> None:
        await super().open()
        limit = self.config.max_concurrent_requests
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
        )

    async def close(self) -> None:
        await self.session.close()
        await super().close()

    async def _post(self, server: ServerSlot, path: str, body: dict[str, Any]) -> Any:
        assert self._slots is not None
        async with (
            self._server_slots[server.url],
            self._slots,
            self.session.post(
                server.url + path, data=json.dumps(body), headers=JSON_HEADERS
            ) as reply,
        ):
            status, raw = reply.status, await reply.read()
        if status != 200:
            raise RetryableFailure(f"HTTP {status}: {raw[:300]!r}")
        return json.loads(raw)


JSON_HEADERS = {"Content-Type": "application/json"}
CLIENTS = {"envloop": ServerClient, "aiohttp": AiohttpClient}


async def measure_client(
    url: str, in_flight: int, requests: int, prompt: list[int], through: str = "envloop"
) -> ClientRun:
    """A fresh client (``through``: a key of :data:`CLIENTS`) limited to ``in_flight``
    sends ``requests`` at once."""
    config = ServerGenerationConfig(
        base_urls=[url], dialect="llamacpp", tokenizer=POLICY, max_concurrent_requests=in_flight
    )
    client = CLIENTS[through](config, make_dialect("llamacpp"), vocab_size=1 << 16)
    await client.open()
    server_stats(url)  # resets the server's peak
    gc.collect()
    with GcTimer() as collector:
        cpu, wall = time.process_time(), time.perf_counter()
        failed = await send_all(client, prompt, requests)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await client.close()
    peak = server_stats(url)["peak_open"]
    retries = client.counts["retries"]
    return ClientRun(in_flight, requests, cpu, collector.seconds, wall, retries, failed, peak)


def server_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url + "/stats", timeout=10) as answer:
        return json.loads(answer.read())


def run_at_limit(
    in_flight: int, requests: int, prompt: list[int], through: str = "envloop"
) -> ClientRun:
    with echo_server(echo_latency_s(in_flight)) as url:
        return asyncio.run(measure_client(url, in_flight, requests, prompt, through))


def median_run(runs: list[ClientRun]) -> ClientRun:
    return sorted(runs, key=lambda run: run.cpu_s)[len(runs) // 2]


def client_section(args: argparse.Namespace, prompt: list[int]) -> list[str]:
    limits = [64, 256, 1024] if args.quick else [64, 1024, 4096]
    requests = 2048 if args.quick else 8192
    repeats = 1 if args.quick else 3
    run_at_limit(16, 64, prompt)  # warm-up: first connections, lazy imports
    rounds = [
        [run_at_limit(limit, requests, prompt, through) for limit in limits for through in CLIENTS]
        for _ in range(repeats)
    ]
    medians = [median_run(list(same)) for same in zip(*rounds)]
    runs, baselines = medians[0::2], medians[1::2]
    lines = [
        f"Client cost per request: `ServerClient` (llama.cpp dialect) sends {requests:,} "
        f"requests at once ({len(prompt)}-token prompt, {REPLY_TOKENS} tokens back) to a "
        "stand-in server in another process that answers each after the latency shown; "
        f"the run with the median client CPU of {repeats}, limits alternating; beside it the "
        "same client sending through one pooled aiohttp session (`AiohttpClient`).",
        "",
        "| in flight (limit) | server latency s | requests | client CPU µs/request "
        "| of which cyclic GC | without GC | through aiohttp µs/request | aiohttp / envloop "
        "| wall s | peak open at the server | retries / failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run, baseline in zip(runs, baselines):
        cpu, collector = run.us_per_request(run.cpu_s), run.us_per_request(run.gc_s)
        other = baseline.us_per_request(baseline.cpu_s)
        lines.append(
            f"| {run.in_flight:,} | {echo_latency_s(run.in_flight):g} | {run.requests:,} "
            f"| {cpu:,.0f} | {collector:,.0f} | {cpu - collector:,.0f} | {other:,.0f} "
            f"| {other / cpu:.2f}x | {run.wall_s:.2f} | {run.peak_open:,} "
            f"| {run.retries} / {run.failed} |"
        )
    first, last = runs[0], runs[-1]
    total = last.us_per_request(last.cpu_s) / first.us_per_request(first.cpu_s)
    own = last.us_per_request(last.cpu_s - last.gc_s) / first.us_per_request(
        first.cpu_s - first.gc_s
    )
    lines += [
        "",
        f"CPU per request at {last.in_flight:,} in flight / at {first.in_flight:,}: "
        f"{total:.2f}x in all, {own:.2f}x without the cyclic GC.",
    ]
    return lines


# --- throughput against HfGeneration -----------------------------------------------------


def make_batch(prompts: list[list[int]], rows: int, pad_id: int) -> BatchedDataDict:
    """``rows`` rows cycling through ``prompts``, right-padded."""
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    width = max(len(p) for p in chosen)
    return BatchedDataDict(
        input_ids=torch.tensor([p + [pad_id] * (width - len(p)) for p in chosen]),
        input_lengths=torch.tensor([len(p) for p in chosen]),
    )


def generated(out: Any, batch: BatchedDataDict) -> list[list[int]]:
    """Each row's generated token ids."""
    starts, lengths = batch["input_lengths"].tolist(), out["generation_lengths"].tolist()
    return [row[s : s + n] for row, s, n in zip(out["output_ids"].tolist(), starts, lengths)]


def time_backends(
    backends: dict[str, Any], batch: BatchedDataDict, repeats: int
) -> tuple[dict[tuple[str, str], list[float]], dict[tuple[str, str], Any]]:
    """Wall times of every (backend, mode) over ``repeats`` rounds, and the last outputs."""
    walls: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], Any] = {}
    for policy in backends.values():  # warm-up
        policy.generate(batch.slice(0, 4), greedy=True)
    for _ in range(repeats):
        for mode in ("greedy", "sampled"):
            for name, policy in backends.items():
                start = time.perf_counter()
                outputs[name, mode] = policy.generate(batch, greedy=mode == "greedy")
                walls.setdefault((name, mode), []).append(time.perf_counter() - start)
    return walls, outputs


def throughput_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    repeats = 1 if args.quick else 7
    prompts = demo_prompts(tokenizer)
    batch = make_batch(prompts, args.rows, tokenizer.pad_token_id or 0)
    server = LlamaServer(converted_gguf(Path(resolve_model(POLICY)))).start()
    try:
        backends = {
            "HfGeneration": HfGeneration({"model_name": POLICY, "max_new_tokens": MAX_NEW_TOKENS}),
            SERVER: ServerGeneration(
                {"base_urls": [server.url], "dialect": "llamacpp", "tokenizer": POLICY,
                 "max_new_tokens": MAX_NEW_TOKENS}
            ),
        }  # fmt: skip
        walls, outputs = time_backends(backends, batch, repeats)
        requests = backends[SERVER].request_stats()
        for policy in backends.values():
            policy.shutdown()
    finally:
        server.stop()
    lines = [
        f"Throughput: bundled policy, {len(prompts)} demo prompts cycled to {batch.size} rows, "
        f"at most {MAX_NEW_TOKENS} new tokens, median of {repeats}; llama-server: "
        f"{server.slots} slots, 1 thread; HfGeneration: 1 torch thread.",
        "",
        "| backend | mode | rows | generated tokens | wall s (min-max) | tokens/s "
        "| vs HfGeneration |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ("greedy", "sampled"):
        base = None
        for name in backends:
            tokens = int(outputs[name, mode]["generation_lengths"].sum())
            times = walls[name, mode]
            wall = statistics.median(times)
            base = base or tokens / wall
            lines.append(
                f"| {name} | {mode} | {batch.size} | {tokens:,} "
                f"| {wall:.2f} ({min(times):.2f}-{max(times):.2f}) "
                f"| {tokens / wall:,.0f} | {tokens / wall / base:.2f}x |"
            )
    hf, served = (generated(outputs[name, "greedy"], batch) for name in backends)
    same = sum(a == b for a, b in zip(hf, served))
    lines += [
        "",
        f"Greedy rows with the same tokens from both backends: {same} of {batch.size}. "
        f"ServerGeneration's HTTP requests: {requests['requests']:,} "
        f"({requests['score_requests']:,} scoring requests for log-probability gaps, "
        f"{requests['retries']} retries, {requests['failed_rows']} failed rows).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sections = ["all", "client", "throughput"]
    parser.add_argument("section", nargs="?", default="all", choices=sections)
    parser.add_argument("--rows", type=int, default=96, help="throughput: rows per call")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    args = parser.parse_args()
    raise_open_files_limit()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(POLICY))
    command = " ".join(["benchmarks/server_client.py", *sys.argv[1:]])
    print(f"`.venv/bin/python {command}` ({os.cpu_count()} cores; load average before: "
          f"{load_avg()})\n", flush=True)  # fmt: skip
    if args.section in ("all", "client"):
        print("\n".join(client_section(args, demo_prompts(tokenizer)[0])) + "\n", flush=True)
    if args.section in ("all", "throughput"):
        print("\n".join(throughput_section(args, tokenizer)) + "\n", flush=True)
    print(f"(load average after: {load_avg()})")


if __name__ == "__main__":
    main()
