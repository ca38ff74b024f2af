"""Which server a request goes to: the one with the fewest requests outstanding, except that
every turn of one sample goes to the server its first turn went to, while that server
answers (its prefix cache holds the sample's earlier turns).

A server that refuses a connection, times out or answers 5xx is set aside for a while and
tried again afterwards, so a server that restarts mid-run is used again once it is back.
The set-aside doubles with each consecutive failure up to a minute, counting only failures
of requests that end after it has passed: when a server dies with a thousand requests open,
they all fail within moments and count as one failure (the server is set aside for
``base_set_aside_s``), so a server restarted a second later is used again about a second
later, not a minute. A request for ``need`` completions at once (a group of samples,
:meth:`ServerClient.generate_group`) goes only to a server that takes that many
(``ServerSlot.parallel``). Only servers that have joined
(answered their probe request, :mod:`server_fleet`) get requests. Pure bookkeeping, no I/O:
one event loop owns a :class:`ServerRouter`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_STICKY_SAMPLES = 1 << 16
"""Samples whose server is remembered (the least recently used are forgotten first)."""
MAX_SET_ASIDE_S = 60.0
MAX_DOUBLINGS = 64
"""Consecutive failures past which the set-aside stops doubling (it is at the cap long
before; ``2.0 ** n`` itself would overflow a float past n = 1023)."""


class NoServerTakes(LookupError):
    """No joined server takes the completions one request asks for (``args[0]``)."""


@dataclass(eq=False)
class ServerSlot:
    """One server and what the router knows of it (``media``: what it said about image
    input at start-up, None when not asked)."""

    url: str
    outstanding: int = 0  # completions asked of it and not answered yet
    failures: int = 0  # consecutive, each ending after the previous set-aside
    down_until: float = 0.0
    media: Any = None
    joined: bool = True  # answered its probe: requests may go to it
    answered: int = 0  # completions it answered (rows: several per grouped request)
    parallel: int = 1  # completions one request may ask for (llama.cpp: its slots)

    def healthy(self, now: float) -> bool:
        return self.down_until <= now


class ServerRouter:
    """Least-outstanding routing with per-sample stickiness over ``urls``.

    >>> router = ServerRouter(["http://a", "http://b"])
    >>> first = router.acquire("sample-0"); second = router.acquire("sample-1")
    >>> first.url, second.url, router.acquire("sample-0").url
    ('http://a', 'http://b', 'http://a')
    """

    def __init__(
        self, urls: Sequence[str], base_set_aside_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.servers = [ServerSlot(url.rstrip("/")) for url in urls]
        self._joined = list(self.servers)
        self.base_set_aside_s = base_set_aside_s
        self.clock = clock
        self._sticky: OrderedDict[Hashable, ServerSlot] = OrderedDict()

    @property
    def joined(self) -> list[ServerSlot]:
        """The servers requests may go to, in the order of ``urls``."""
        return list(self._joined)

    def leave(self, server: ServerSlot) -> None:
        """Take ``server`` out of the routing until it joins (again): :meth:`join`."""
        server.joined = False
        self._joined = [s for s in self.servers if s.joined]

    def join(self, server: ServerSlot) -> None:
        """Let requests go to ``server`` (it answered its probe), starting afresh: no
        failures, not set aside."""
        server.joined, server.failures, server.down_until = True, 0, 0.0
        self._joined = [s for s in self.servers if s.joined]

    def acquire(
        self, key: Hashable | None = None, *, need: int = 1, keys: Sequence[Hashable] = ()
    ) -> ServerSlot:
        """The server for a request of sample ``key`` (None: no sample affinity) asking for
        ``need`` completions, counted as outstanding until :meth:`release`; the samples of
        ``keys`` stick to it too. Raises :class:`NoServerTakes` when no joined server takes
        ``need`` completions per request."""
        now = self.clock()
        server = self._sticky.get(key) if key is not None else None
        usable = server is not None and server.joined and server.parallel >= need
        if server is None or not usable or not server.healthy(now):
            server = self._least_outstanding(now, need)
        if server is None:
            raise NoServerTakes(need)
        for sample in (key, *keys):
            if sample is not None:
                self._sticky[sample] = server
                self._sticky.move_to_end(sample)
        while len(self._sticky) > MAX_STICKY_SAMPLES:
            self._sticky.popitem(last=False)
        server.outstanding += need
        return server

    def group_size(self) -> int:
        """The most completions per request every joined server takes (1 with none
        joined), so that a group can go to any of them."""
        return min((s.parallel for s in self._joined), default=1)

    def release(self, server: ServerSlot, *, ok: bool, n: int = 1) -> None:
        """A request to ``server`` for ``n`` completions ended: answered (``ok``), or failed
        to reach it."""
        server.outstanding -= n
        if ok:
            server.answered += n
            server.failures, server.down_until = 0, 0.0
            return
        now = self.clock()
        if server.down_until > now:  # sent before it was set aside: fails with the others
            return
        server.failures += 1
        doublings = min(server.failures - 1, MAX_DOUBLINGS)
        wait = min(self.base_set_aside_s * 2.0**doublings, MAX_SET_ASIDE_S)
        server.down_until = now + wait

    def _least_outstanding(self, now: float, need: int = 1) -> ServerSlot | None:
        if not self._joined:
            raise RuntimeError("no server has joined the routing (none answered its probe)")
        able = self._joined if need == 1 else [s for s in self._joined if s.parallel >= need]
        if not able:
            return None
        best: ServerSlot | None = None
        for server in able:  # the healthy one with the fewest outstanding
            if server.down_until <= now and (best is None or server.outstanding < best.outstanding):
                best = server
        if best is not None:
            return best
        return min(able, key=lambda s: s.down_until)  # the one back soonest
