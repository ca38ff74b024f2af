"""A stand-in llama.cpp server for ``server_client.py``: answers every ``POST /completion``
with the same 16-token reply after a fixed latency, and counts the requests open at once.

It runs in its own process (:func:`echo_server` starts it), so that its CPU time is not
the client's. ``GET /stats`` answers ``{"served": n, "peak_open": k}``, ``k`` being the most
requests open at once since the previous ``/stats``.

    .venv/bin/python benchmarks/_http_echo.py --latency 2.0   # prints its URL, then serves
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

BACKLOG = 8192
"""Pending connections the listening socket queues (the kernel caps it at somaxconn)."""
REPLY_TOKENS = 16


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to the hard one; returns it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def llama_reply(tokens: int = REPLY_TOKENS) -> bytes:
    """A llama.cpp ``/completion`` answer of ``tokens`` tokens, each with its probability,
    ended by EOS."""
    ids = [100 + i for i in range(tokens)]
    return json.dumps(
        {
            "content": "",
            "tokens": ids,
            "completion_probabilities": [{"id": t, "prob": math.exp(-0.5)} for t in ids],
            "stop_type": "eos",
            "tokens_predicted": tokens,
        }
    ).encode()


class EchoApp:
    """The handlers and their counters."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s, self.reply = latency_s, llama_reply()
        self.open = self.peak_open = self.served = 0

    async def completion(self, request: web.Request) -> web.Response:
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            await request.read()
            await asyncio.sleep(self.latency_s)
        finally:
            self.open -= 1
        self.served += 1
        return web.Response(body=self.reply, content_type="application/json")

    async def stats(self, request: web.Request) -> web.Response:
        answer = {"served": self.served, "peak_open": self.peak_open}
        self.peak_open = self.open
        return web.json_response(answer)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/completion", self.completion), web.get("/stats", self.stats)])
        return app


async def serve(latency_s: float) -> None:
    """Serve on 127.0.0.1 on a free port, print the URL, and serve until killed."""
    runner = web.AppRunner(EchoApp(latency_s).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG)
    await site.start()
    port = runner.addresses[0][1]
    print(f"http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


@contextlib.contextmanager
def echo_server(latency_s: float) -> Iterator[str]:
    """Run this module as a separate process for the ``with`` block; yields its URL."""
    command = [sys.executable, str(Path(__file__).resolve()), "--latency", str(latency_s)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        if not url:
            raise RuntimeError(f"the echo server exited at start-up (code {process.wait()})")
        yield url
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--latency", type=float, default=2.0, help="seconds before each answer")
    args = parser.parse_args()
    raise_open_files_limit()
    asyncio.run(serve(args.latency))


if __name__ == "__main__":
    main()
