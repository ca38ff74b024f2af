"""Progress of ``envloop run`` on the terminal, updated while generation runs, after every
turn, after every finished sample (async rollouts) and after every batch.

On a terminal: one live line (a bar of samples finished, turns done, tokens generated,
generation tokens per second, running mean reward per task, elapsed time) redrawn in place
after every turn and every finished sample and, while the policy generates, at most every
``REDRAW_INTERVAL_S``. When the output is not a terminal, or with ``quiet``: the same facts
as plain log lines, one per finished batch (``progress: ...``) and at most one per
``log_interval_s`` in between (``progress (running): ...``), so logs are not flooded.

In a sync rollout, a batch's samples are counted as finished when they take no further
turn, and their rewards once the batch ends; in an async rollout (``per_sample``), each
sample with its reward as the rollout hands it over (:meth:`Progress.on_sample`).

>>> import io
>>> out = io.StringIO()
>>> progress = Progress(total=4, stream=out)
>>> progress.update([{"task": "math", "total_reward": 1.0, "num_turns": 2}] * 2,
...                 generated_tokens=300, generation_s=2.0)
>>> progress.line(elapsed_s=1.5)
'2/4 samples, 4 turns, 300 tokens, 150 tokens/s, mean reward: math 1.000 (2), 1.5 s'
"""

from __future__ import annotations

import copy
import sys
import threading
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
    else log lines). ``per_sample``: the running batch's samples are reported one by one as
    they finish (:meth:`on_sample`; async rollouts), so its own count of ended samples
    (``RolloutProgress.samples_done``) is not used. ``clock`` (seconds) is injectable for
    tests. The policy may report tokens (:meth:`on_tokens`) from another thread."""

    def __init__(
        self,
        total: int,
        stream: IO[str] | None = None,
        quiet: bool = False,
        *,
        per_sample: bool = False,
        log_interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.live = not quiet and _is_tty(self.stream)
        self.per_sample = per_sample
        self.log_interval_s = log_interval_s
        self.clock = clock
        self.stats: dict[str, TaskStats] = {}
        self.generated_tokens = 0  # by finished batches
        self.generation_s = 0.0
        self.running: RolloutProgress | None = None  # the batch in flight, after its last turn
        self.running_records: list[Mapping[str, Any]] = []  # its finished samples (on_sample)
        self.live_tokens = 0  # generated (on_tokens) and not yet in ``running``
        self.started = clock()
        self._last_line = self._last_draw = self.started
        self._lock = threading.Lock()  # the policy's thread draws too (on_tokens)

    @property
    def finished(self) -> int:
        """Samples of finished batches."""
        return sum(s.samples for s in self.stats.values())

    def start(self) -> None:
        """Draw the empty bar (live mode only; log lines start with the first turn)."""
        self.started = self._last_line = self.clock()
        if self.live:
            self._draw()

    def on_turn(self, running: RolloutProgress) -> None:
        """The running batch finished a turn (a rollout's ``on_turn`` option): redraw; a log
        line only when ``log_interval_s`` has passed since the last one. The tokens the
        snapshot newly counts leave the live count (in an async rollout, rows still
        generating keep theirs)."""
        with self._lock:
            before = self.running.generated_tokens if self.running else 0
            self.live_tokens = max(0, self.live_tokens - (running.generated_tokens - before))
            self.running = running
        self._redraw_within_batch()

    def on_sample(self, record: Mapping[str, Any]) -> None:
        """A sample of the running batch finished (its record: ``task``, ``total_reward``,
        ``num_turns``): counted at once, and redrawn as after a turn."""
        with self._lock:
            self.running_records.append(record)
        self._redraw_within_batch()

    def on_tokens(self, count: int) -> None:
        """The policy generated ``count`` more tokens (``HfGeneration.on_decode_step``):
        redraw the live line at most every ``REDRAW_INTERVAL_S``, a log line at most every
        ``log_interval_s``."""
        with self._lock:
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
        """Count a finished batch (all its sample records, whether or not they were reported
        by :meth:`on_sample`, its generated tokens and generation seconds) and redraw."""
        with self._lock:
            tally(records, self.stats)
            self.generated_tokens += generated_tokens
            self.generation_s += generation_s
            self.running = None
            self.running_records = []
            self.live_tokens = 0
        self._draw()

    def close(self) -> None:
        """End the live line (nothing to do for log lines)."""
        if self.live:
            self.stream.write("\n")
            self.stream.flush()

    def bar(self) -> str:
        """``[#####-----]`` filled in proportion to the samples finished."""
        done = self._samples_done()
        filled = round(BAR_WIDTH * done / self.total) if self.total else BAR_WIDTH
        return "[" + "#" * filled + "-" * (BAR_WIDTH - filled) + "]"

    def line(self, elapsed_s: float) -> str:
        """Samples finished, turns done, tokens generated (the current turn's so far
        included), generated tokens per second of generation in finished turns (``-``
        before any), running mean reward per task (finished samples), elapsed time."""
        run = self.running
        done = self._samples_done()
        turns = sum(s.turns_sum for s in self.stats.values()) + (run.turns if run else 0)
        tokens = self.generated_tokens + (run.generated_tokens if run else 0)
        seconds = self.generation_s + (run.generation_s if run else 0.0)
        rate = f"{tokens / seconds:.0f}" if seconds > 0 else "-"
        tokens += self.live_tokens
        rewards = ", ".join(
            f"{task} {s.mean_reward:.3f} ({s.samples})" for task, s in self._stats_so_far().items()
        )
        return (
            f"{done}/{self.total} samples, {turns} turn{'s' * (turns != 1)}, "
            f"{tokens} token{'s' * (tokens != 1)}, {rate} tokens/s, "
            f"mean reward: {rewards or '-'}, {elapsed_s:.1f} s"
        )

    def _samples_done(self) -> int:
        """Samples finished: those of finished batches, and of the running batch those
        reported by :meth:`on_sample` (``per_sample``) or else those that take no further
        turn."""
        if self.per_sample:
            return self.finished + len(self.running_records)
        return self.finished + (self.running.samples_done if self.running else 0)

    def _stats_so_far(self) -> dict[str, TaskStats]:
        """Per task, the samples of finished batches and those reported by :meth:`on_sample`."""
        if not self.running_records:
            return self.stats
        stats = copy.deepcopy(self.stats)
        tally(self.running_records, stats)
        return stats

    @property
    def _mid_batch(self) -> bool:
        return self.running is not None or self.live_tokens > 0 or bool(self.running_records)

    def _redraw_within_batch(self) -> None:
        """Redraw the live line; a log line only when ``log_interval_s`` has passed."""
        if self.live or self.clock() - self._last_line >= self.log_interval_s:
            self._draw()

    def _draw(self) -> None:
        with self._lock:
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
