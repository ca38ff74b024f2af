"""Progress of ``envloop run`` on the terminal, updated while generation runs, after every
turn and after every batch.

On a terminal: one live line (a bar of samples finished, turns done, tokens generated,
generation tokens per second, running mean reward per task, elapsed time) redrawn in place
after every turn and, while the policy generates, at most every ``REDRAW_INTERVAL_S``. When
the output is not a terminal, or with ``quiet``: the same facts as plain log lines, one per
finished batch (``progress: ...``) and at most one per ``log_interval_s`` in between
(``progress (running): ...``), so logs are not flooded.

>>> import io
>>> out = io.StringIO()
>>> progress = Progress(total=4, stream=out)
>>> progress.update([{"task": "math", "total_reward": 1.0, "num_turns": 2}] * 2,
...                 generated_tokens=300, generation_s=2.0)
>>> progress.line(elapsed_s=1.5)
'2/4 samples, 4 turns, 300 tokens, 150 tokens/s, mean reward: math 1.000 (2), 1.5 s'
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO, TYPE_CHECKING, Any

from envloop.run.metrics import TaskStats, tally

if TYPE_CHECKING:
    from envloop.experience.rollout_metrics import RolloutProgress

BAR_WIDTH = 24
LOG_INTERVAL_S = 10.0
"""Least seconds between two plain progress lines within a batch."""
REDRAW_INTERVAL_S = 0.5
"""Least seconds between two redraws of the live line for generated tokens alone."""


class Progress:
    """Tracks finished samples and the running batch, and draws them (a live bar on a TTY,
    else log lines). ``clock`` (seconds) is injectable for tests."""

    def __init__(
        self,
        total: int,
        stream: IO[str] | None = None,
        quiet: bool = False,
        *,
        log_interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.live = not quiet and _is_tty(self.stream)
        self.log_interval_s = log_interval_s
        self.clock = clock
        self.stats: dict[str, TaskStats] = {}
        self.generated_tokens = 0  # by finished batches
        self.generation_s = 0.0
        self.running: RolloutProgress | None = None  # the batch in flight, after its last turn
        self.live_tokens = 0  # generated since the last turn ended (on_tokens)
        self.started = clock()
        self._last_line = self._last_draw = self.started

    @property
    def finished(self) -> int:
        return sum(s.samples for s in self.stats.values())

    def start(self) -> None:
        """Draw the empty bar (live mode only; log lines start with the first turn)."""
        self.started = self._last_line = self.clock()
        if self.live:
            self._draw()

    def on_turn(self, running: RolloutProgress) -> None:
        """The running batch finished a turn (a rollout's ``on_turn`` option): redraw; a log
        line only when ``log_interval_s`` has passed since the last one."""
        self.running = running
        self.live_tokens = 0
        if self.live or self.clock() - self._last_line >= self.log_interval_s:
            self._draw()

    def on_tokens(self, count: int) -> None:
        """The policy generated ``count`` more tokens (``HfGeneration.on_decode_step``):
        redraw the live line at most every ``REDRAW_INTERVAL_S``, a log line at most every
        ``log_interval_s``."""
        self.live_tokens += count
        now = self.clock()
        since, interval = (
            (now - self._last_draw, REDRAW_INTERVAL_S)
            if self.live
            else (now - self._last_line, self.log_interval_s)
        )
        if since >= interval:
            self._draw()

    def update(
        self,
        records: Iterable[Mapping[str, Any]],
        generated_tokens: int = 0,
        generation_s: float = 0.0,
    ) -> None:
        """Count a finished batch (its sample records, generated tokens and generation
        seconds) and redraw."""
        tally(records, self.stats)
        self.generated_tokens += generated_tokens
        self.generation_s += generation_s
        self.running = None
        self.live_tokens = 0
        self._draw()

    def close(self) -> None:
        """End the live line (nothing to do for log lines)."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def bar(self) -> str:
        """``[#####-----]`` filled in proportion to the samples finished."""
        done = self.finished + (self.running.samples_done if self.running else 0)
        filled = round(BAR_WIDTH * done / self.total) if self.total else BAR_WIDTH
        return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"

    def line(self, elapsed_s: float) -> str:
        """Samples finished, turns done, tokens generated (the current turn's so far
        included), generated tokens per second of generation in finished turns (``-``
        before any), running mean reward per task (finished samples), elapsed time."""
        run = self.running
        done = self.finished + (run.samples_done if run else 0)
        turns = sum(s.turns_sum for s in self.stats.values()) + (run.turns if run else 0)
        tokens = self.generated_tokens + (run.generated_tokens if run else 0)
        seconds = self.generation_s + (run.generation_s if run else 0.0)
        rate = f"{tokens / seconds:.0f}" if seconds > 0 else "-"
        tokens += self.live_tokens
        rewards = ", ".join(
            f"{task} {s.mean_reward:.3f} ({s.samples})" for task, s in self.stats.items()
        )
        return (
            f"{done}/{self.total} samples, {turns} turn{'s' * (turns != 1)}, "
            f"{tokens} token{'s' * (tokens != 1)}, {rate} tokens/s, "
            f"mean reward: {rewards or '-'}, {elapsed_s:.1f} s"
        )

    @property
    def _mid_batch(self) -> bool:
        return self.running is not None or self.live_tokens > 0

    def _draw(self) -> None:
        now = self.clock()
        if self.live:
            self.stream.write(f"\r{self.bar()} {self.line(now - self.started)}\x1b[K")
            self._last_draw = now
        else:
            label = "progress (running)" if self._mid_batch else "progress"
            self.stream.write(f"{label}: {self.line(now - self.started)}\n")
            self._last_line = now
        self.stream.flush()


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
