"""The per-phase wall-clock timer behind a rollout's ``timing/<phase>_s`` metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

TIMING_PHASES = (
    "flatten",
    "generation",
    "gen_bookkeeping",
    "env_startup",
    "env_step",
    "rewards_and_status",
    "obs_tokenization",
)
"""Phases of a turn, in order; ``timing/<phase>_s`` sums each over the rollout.
``env_startup`` is the wait for environment actors' constructors before their first step
(never counted in ``env_step``, nor against ``env_step_timeout_s``)."""


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase. Phases of one name that overlap (the
    async engine's concurrent generation or environment calls) count once: a phase's
    seconds are those during which at least one of its kind was under way.

    >>> timer = PhaseTimer()
    >>> with timer.phase("env_step"):
    ...     with timer.phase("env_step"):  # a second call while the first runs
    ...         pass
    >>> list(timer.seconds), timer.seconds["env_step"] < 1.0
    (['env_step'], True)
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.started = time.perf_counter()
        self._running: dict[str, int] = defaultdict(int)
        self._since: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self._running[name]:
            self._since[name] = time.perf_counter()
        self._running[name] += 1
        try:
            yield
        finally:
            self._running[name] -= 1
            if not self._running[name]:
                self.seconds[name] += time.perf_counter() - self._since[name]
