"""The agent endpoint's overhead per chat completion, side by side with the HTTP floor, at
1, 64 and 1,024 concurrent agents.

Each agent is an ``openai.AsyncOpenAI`` client (one shared HTTP connection pool) making a
3-call session (each call extends the conversation with the response and a tool result).
The backend costs nothing: it answers every prompt with the same 8 tokens at once.

- ``floor``: the same client and calls against a bare Starlette app on the same uvicorn
  setup that answers a canned ``chat.completion`` (HTTP, JSON and the SDK's own cost).
- ``endpoint``: the same calls against :class:`envloop.agents.AgentEndpoint` (request
  checking, the session's prompt tokens, the backend call, the response, the recording).

Reported per call: wall time / calls (throughput view, all agents at once), and the mean
latency of one call as an agent sees it. ``overhead`` = endpoint - floor; ``ratio`` =
endpoint / floor. Client and server share this process (as ``run_agent_rollouts`` runs
them), so both share its GIL.

    .venv/bin/python benchmarks/agent_endpoint.py [--agents 1 64 1024] [--calls 3] [--repeats 1]

On a busy machine, ``--repeats 5`` shows each side's best of 5 runs (the floor's and the
endpoint's runs interleaved).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import openai
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop.agents import AgentEndpoint
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.interfaces import GenerationInterface
from envloop.models.tiny import build_tiny_tokenizer

REPLY = "The answer is 42."
TIMEOUT = httpx2.Timeout(600.0, connect=300.0)  # 1,024 connections open at once


class ZeroCostPolicy(GenerationInterface):
    """Answers every prompt with the same tokens (EOS-terminated), at once, on the caller's
    event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.reply = [*tokenizer.encode(REPLY), tokenizer.eos_token_id]

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict[Any]:
        rows = data["input_ids"].shape[0]
        length = int(data["input_lengths"].max())
        ids = torch.cat([data["input_ids"][:, :length], torch.tensor([self.reply] * rows)], 1)
        return BatchedDataDict(
            output_ids=ids,
            logprobs=torch.zeros(ids.shape),
            generation_lengths=torch.full((rows,), len(self.reply)),
            unpadded_sequence_lengths=data["input_lengths"] + len(self.reply),
        )

    async def generate_async(self, data: Any, greedy: bool = False):  # type: ignore[override]
        yield 0, self.generate(data, greedy)


class FloorServer:
    """A bare Starlette app on uvicorn answering a canned chat completion."""

    def __init__(self) -> None:
        body = {
            "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }  # fmt: skip

        async def chat(request: Request) -> JSONResponse:
            json.loads(await request.body())
            return JSONResponse(body)

        app = Starlette(routes=[Route("/s/{session}/v1/chat/completions", chat, methods=["POST"])])
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", backlog=4096, timeout_keep_alive=600
        )
        self.server = uvicorn.Server(config)
        threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        ).start()
        while not self.server.started:
            time.sleep(0.01)

    def url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.socket.getsockname()[1]}/s/{session}/v1"

    def stop(self) -> None:
        self.server.should_exit = True


async def agent(client: openai.AsyncOpenAI, calls: int, latencies: list[float]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 * 7?"}]
    for k in range(calls):
        start = time.perf_counter()
        reply = await client.chat.completions.create(model="m", messages=messages)
        latencies.append(time.perf_counter() - start)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        messages.append({"role": "user", "content": f"Check {k}."})


async def run_agents(urls: list[str], calls: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, mean latency) per call of ``len(urls)``
    agents at once."""
    http = openai.DefaultAsyncHttpxClient(
        limits=httpx2.Limits(max_connections=4096, max_keepalive_connections=4096)
    )
    clients = [
        openai.AsyncOpenAI(
            base_url=url, api_key="unused", max_retries=0, http_client=http, timeout=TIMEOUT
        )
        for url in urls
    ]
    latencies: list[float] = []
    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(agent(c, calls, latencies) for c in clients))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    await http.aclose()
    n = len(latencies)
    return wall / n, cpu / n, sum(latencies) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each side, interleaved; the best is shown"
    )
    args = parser.parse_args()
    tokenizer = build_tiny_tokenizer()
    floor = FloorServer()
    endpoint = AgentEndpoint(ZeroCostPolicy(tokenizer), tokenizer).start()
    asyncio.run(run_agents([floor.url("warm")] * 4, 2))  # warm both up
    asyncio.run(run_agents([endpoint.open_session().base_url for _ in range(4)], 2))
    print(f"{args.calls} calls per agent, zero-cost backend; ms per call (CPU: this process,")
    print("client and server together; latency: one call as its agent waits for it)")
    print(f"{'agents':>7} | {'CPU floor':>9} {'endpoint':>8} {'overhead':>8} {'ratio':>5} | "
          f"{'wall floor':>10} {'endpoint':>8} {'ratio':>5} | {'latency floor':>13} "
          f"{'endpoint':>8}")  # fmt: skip
    for n in args.agents:
        floors, endpoints = [], []
        for _ in range(args.repeats):
            floors.append(
                asyncio.run(run_agents([floor.url(str(i)) for i in range(n)], args.calls))
            )
            urls = [endpoint.open_session().base_url for _ in range(n)]
            endpoints.append(asyncio.run(run_agents(urls, args.calls)))
        floor_wall, floor_cpu, floor_latency = (min(column) for column in zip(*floors))
        wall, cpu, latency = (min(column) for column in zip(*endpoints))
        print(
            f"{n:>7} | {floor_cpu * 1e3:>9.2f} {cpu * 1e3:>8.2f} {(cpu - floor_cpu) * 1e3:>8.2f} "
            f"{cpu / floor_cpu:>5.2f} | {floor_wall * 1e3:>10.2f} {wall * 1e3:>8.2f} "
            f"{wall / floor_wall:>5.2f} | {floor_latency * 1e3:>13.2f} {latency * 1e3:>8.2f}"
        )
    endpoint.stop()
    floor.stop()


if __name__ == "__main__":
    main()
