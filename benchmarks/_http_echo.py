"""A stand-in llama.cpp server for ``server_client.py`` and ``server_fleet.py``: answers
every ``POST /completion`` with the same 16-token reply after a fixed latency (a request for
``n_cmpl`` completions, or listing several prompts: a list of that many answers, as
llama-server answers), and counts the requests open at once.

It runs in its own process (:func:`echo_server` starts it), so that its CPU time is not
the client's. ``GET /props`` answers ``{"total_slots": slots}`` (``--slots``, 1 by default:
the client then sends one completion per request); ``GET /stats`` answers
``{"served": n, "peak_open": k}``, ``k`` being the most requests open at once since the
previous ``/stats``.

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


def llama_reply(tokens: int = REPLY_TOKENS, n: int = 1) -> bytes:
    """A llama.cpp ``/completion`` answer of ``tokens`` tokens, each with its probability,
    ended by EOS; for ``n`` > 1 completions, a list of ``n`` such answers."""
    ids = [100 + i for i in range(tokens)]
    answers = [
        {
            "index": j,
            "content": "",
            "tokens": ids,
            "completion_probabilities": [{"id": t, "prob": math.exp(-0.5)} for t in ids],
            "stop_type": "eos",
            "tokens_predicted": tokens,
        }
        for j in range(n)
    ]
    return json.dumps(answers if n > 1 else answers[0]).encode()


class EchoApp:
    """The handlers and their counters."""

    def __init__(self, latency_s: float, slots: int = 1) -> None:
        self.latency_s, self.slots = latency_s, slots
        self.replies = {n: llama_reply(n=n) for n in range(1, slots + 1)}
        self.open = self.peak_open = self.served = 0

    async def completion(self, request: web.Request) -> web.Response:
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            body = json.loads(await request.read())
            prompt = body.get("prompt")
            listed = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], list)
            n = len(prompt) if listed else body.get("n_cmpl", 1)
            await asyncio.sleep(self.latency_s)
        finally:
            self.open -= 1
        if n not in self.replies:
            return web.json_response({"error": f"{n} answers > {self.slots} slots"}, status=400)
        self.served += 1
        return web.Response(body=self.replies[n], content_type="application/json")

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"total_slots": self.slots})

    async def stats(self, request: web.Request) -> web.Response:
        answer = {"served": self.served, "peak_open": self.peak_open}
        self.peak_open = self.open
        return web.json_response(answer)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [web.post("/completion", self.completion), web.get("/stats", self.stats),
             web.get("/props", self.props)]
        )  # fmt: skip
        return app


async def serve(latency_s: float, slots: int = 1) -> None:
    """Serve on 127.0.0.1 on a free port, print the URL, and serve until killed."""
    runner = web.AppRunner(EchoApp(latency_s, slots).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=BACKLOG)
    await site.start()
    port = runner.addresses[0][1]
    print(f"http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


@contextlib.contextmanager
def echo_server(latency_s: float, slots: int = 1) -> Iterator[str]:
    """Run this module as a separate process for the ``with`` block; yields its URL."""
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, "--latency", str(latency_s), "--slots", str(slots)]
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
    parser.add_argument("--slots", type=int, default=1, help="most completions per request")
    args = parser.parse_args()
    raise_open_files_limit()
    asyncio.run(serve(args.latency, args.slots))


if __name__ == "__main__":
    main()
