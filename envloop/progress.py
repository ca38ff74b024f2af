"""Progress of ``envloop run`` on the terminal, updated after every finished batch.

On a terminal: one live line (a bar of samples finished, turns done, running mean reward
per task, elapsed time) redrawn in place. When the output is not a terminal, or with
``quiet``: the same facts as one plain log line per batch.

>>> import io
>>> out = io.StringIO()
>>> progress = Progress(total=4, stream=out)
>>> progress.update([{"task": "math", "total_reward": 1.0, "num_turns": 2}] * 2)
>>> progress.line(elapsed_s=1.5)
'2/4 samples, 4 turns, mean reward: math 1.000 (2), 1.5 s'
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping
from typing import IO, Any

from envloop.run_metrics import TaskStats, tally

BAR_WIDTH = 24


class Progress:
    """Tracks finished samples and draws them (a live bar on a TTY, else log lines)."""

    def __init__(self, total: int, stream: IO[str] | None = None, quiet: bool = False) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.live = not quiet and _is_tty(self.stream)
        self.stats: dict[str, TaskStats] = {}
        self.started = time.perf_counter()

    @property
    def finished(self) -> int:
        return sum(s.samples for s in self.stats.values())

    def start(self) -> None:
        """Draw the empty bar (live mode only; log lines start with the first batch)."""
        self.started = time.perf_counter()
        if self.live:
            self.stream.write(f"\r{self.bar()} {self.line(0.0)}\x1b[K")
            self.stream.flush()

    def update(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Count a batch of finished sample records and redraw."""
        tally(records, self.stats)
        elapsed = time.perf_counter() - self.started
        if self.live:
            self.stream.write(f"\r{self.bar()} {self.line(elapsed)}\x1b[K")
        else:
            self.stream.write(f"progress: {self.line(elapsed)}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line (nothing to do for log lines)."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def bar(self) -> str:
        """``[#####-----]`` filled in proportion to the samples finished."""
        filled = round(BAR_WIDTH * self.finished / self.total) if self.total else BAR_WIDTH
        return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"

    def line(self, elapsed_s: float) -> str:
        """Samples finished, turns done, running mean reward per task, elapsed time."""
        turns = sum(s.turns_sum for s in self.stats.values())
        rewards = ", ".join(
            f"{task} {s.mean_reward:.3f} ({s.samples})" for task, s in self.stats.items()
        )
        return (
            f"{self.finished}/{self.total} samples, {turns} turns, "
            f"mean reward: {rewards or '-'}, {elapsed_s:.1f} s"
        )


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
