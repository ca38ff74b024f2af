"""Weight updates of a server backend: generation attempts held back while one runs
(:class:`AttemptGate`), and each server's reload requests (:func:`reload_servers`).

An update first closes the gate: attempts not yet sent wait, and the update waits until
every attempt already sent has been answered (or given up). So no attempt is in flight
while a server reloads, and the answer to each attempt comes from the weights that were
served when it was sent: its policy version. Then every server, concurrently, gets its
dialect's requests (:class:`~envloop.models.generation.server_dialects.WeightReload`); the
gate opens again when all are done, whether they succeeded or not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from envloop.models.generation.server_dialects import ControlRequest, WeightReload
from envloop.models.generation.server_routing import ServerSlot

Send = Callable[[ServerSlot, ControlRequest], Awaitable[None]]
"""Sends one weight-update request to a server; raises :class:`ControlFailed` if it fails."""


class ControlFailed(Exception):
    """A weight-update request failed; the text names the request and the server's answer."""


class WeightUpdateFailed(RuntimeError):
    """Some servers did not reload; the text lists each with its error."""


class AttemptGate:
    """Admits generation attempts, except while a weight update holds it closed.

    Lives on one event loop.

    >>> async def demo():
    ...     gate, log = AttemptGate(), []
    ...     async def attempt(name):
    ...         async with gate.admitted():
    ...             log.append(f"{name} sent")
    ...             await asyncio.sleep(0.01)
    ...     async def update():
    ...         async with gate.closed():
    ...             log.append("reload")
    ...     first = asyncio.create_task(attempt("a"))
    ...     await asyncio.sleep(0)
    ...     await asyncio.gather(update(), attempt("b"), first)
    ...     return log
    >>> asyncio.run(demo())
    ['a sent', 'reload', 'b sent']
    """

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._in_flight = 0
        self._one_update = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """One attempt, from when it may be sent until it is answered or given up."""
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        self._drained.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._drained.set()

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """Hold new attempts back and wait for those in flight to end (one update at a
        time)."""
        async with self._one_update:
            self._open.clear()
            try:
                await self._drained.wait()
                yield
            finally:
                self._open.set()


async def reload_servers(
    send: Send, servers: Sequence[ServerSlot], reload: WeightReload
) -> dict[str, str]:
    """Send ``reload``'s requests to every server at once; returns the error of each server
    that failed, by URL, in the order of ``servers`` (empty: all reloaded)."""
    errors = await asyncio.gather(*(_reload_one(send, server, reload) for server in servers))
    return {server.url: error for server, error in zip(servers, errors) if error}


async def _reload_one(send: Send, server: ServerSlot, reload: WeightReload) -> str | None:
    """Pause, reload (unless a pause failed) and resume one server; its errors, or None."""
    errors = []
    try:
        for request in (*reload.pause, reload.reload):
            await send(server, request)
    except ControlFailed as exc:
        errors.append(str(exc))
    for request in reload.resume:
        try:
            await send(server, request)
        except ControlFailed as exc:
            errors.append(str(exc))
    return "; ".join(errors) or None
