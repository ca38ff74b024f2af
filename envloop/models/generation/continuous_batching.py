"""Continuous batching: one decode loop per model, which requests join at every step.

:class:`ContinuousBatcher` runs a :class:`~envloop.models.generation.decode_loop.DecodeBatch`
on its own thread while there is work. Each step, before the model runs, it admits waiting
requests (first come, first served) up to ``capacity`` rows; a row that finishes frees its
place at once, so a long response never holds back the requests behind it. Requests are
submitted from any thread and answered through ``concurrent.futures.Future``; a batch
submitted in one call is admitted in its order, so with the same arrivals the same rows
share the same steps.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

import torch

from envloop.models.generation.decode_loop import (
    DecodeBatch,
    DecodeRequest,
    DecodeSettings,
    SampleResult,
)
from envloop.models.generation.stop_strings import StopWatcher, TokenBytes


@dataclass
class DecodeStats:
    """Counters of a batcher's work since it was created."""

    requests: int = 0
    """Requests submitted."""
    prefills: int = 0
    """Forward passes that prefilled newly admitted prompts."""
    decode_steps: int = 0
    """Steps of the decode loop (one token for every running row)."""
    joined_running: int = 0
    """Requests admitted while other rows were mid-generation."""
    peak_rows: int = 0
    """Most rows decoded in one step."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _Job:
    request: DecodeRequest
    future: Future[SampleResult]


class ContinuousBatcher:
    """A decode loop over ``model`` that admits requests whenever a row is free.

    Args:
        model: the causal LM (already on its device, in eval mode).
        tokenizer: its tokenizer, for stop strings.
        settings: sampling settings and EOS / pad ids shared by every row.
        generator: seeds each sampled request's own random stream (drawn at submission).
        capacity: most rows decoded together.
        on_step: called on the loop's thread after every step with the number of tokens it
            generated.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: DecodeSettings,
        generator: torch.Generator,
        capacity: int,
        on_step: Callable[[int], None],
    ) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.generator, self.capacity, self.on_step = generator, capacity, on_step
        self.stats = DecodeStats()
        self._token_bytes = TokenBytes(tokenizer)
        self._lock = threading.Lock()
        self._waiting: deque[_Job] = deque()
        self._running = False

    def submit(
        self,
        prompts: Sequence[torch.Tensor],
        budgets: Sequence[int],
        stop_strings: Sequence[list[str] | None],
        greedy: bool,
        visions: Sequence[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[tuple[DecodeRequest, Future[SampleResult]]]:
        """Queue one request per prompt; each future gets its row's :class:`SampleResult`.
        ``visions``: each prompt's vision inputs (see :attr:`DecodeRequest.vision`), or None.

        A budget of 0 is answered at once with no tokens (``truncated=True``). To stop
        waiting for a request, set its ``abandoned`` (or cancel its future before it runs).
        """
        jobs = []
        with self._lock:  # seeds drawn in submission order: the same calls, the same seeds
            seeds = [] if greedy else _seeds(self.generator, len(prompts))
        visions = visions or [None] * len(prompts)
        for k, (prompt, budget, stops) in enumerate(zip(prompts, budgets, stop_strings)):
            stop = StopWatcher(stops, self._token_bytes, self.tokenizer) if stops else None
            rng = None if greedy else random.Random(seeds[k])
            request = DecodeRequest(prompt, budget, greedy, rng, stop, visions[k])
            jobs.append(_Job(request, Future()))
        with self._lock:
            self.stats.requests += len(jobs)
            for job in jobs:
                if job.request.budget > 0:
                    self._waiting.append(job)
                elif job.future.set_running_or_notify_cancel():
                    job.future.set_result(SampleResult(truncated=True))
            if self._waiting and not self._running:
                self._running = True
                threading.Thread(target=self._loop, name="envloop-decode", daemon=True).start()
        return [(job.request, job.future) for job in jobs]

    def _loop(self) -> None:
        batch = DecodeBatch(self.model, self.settings)
        futures: dict[DecodeRequest, Future[SampleResult]] = {}
        try:
            with torch.no_grad():
                while True:
                    with self._lock:
                        joining = self._take(batch)
                        if not joining and not batch.rows:
                            self._running = False
                            return
                    if joining:
                        self._admit(batch, joining, futures)
                    rows = len(batch)
                    for row in batch.step():
                        futures.pop(row).set_result(row.result)
                    running = set(batch.rows)
                    for row in [r for r in futures if r.abandoned and r not in running]:
                        del futures[row]  # dropped from the batch; nobody waits for it
                    self.stats.decode_steps += 1
                    self.on_step(rows)
        except BaseException as error:  # the model failed: every waiting caller gets it
            with self._lock:
                self._running = False
                pending = [*futures.values(), *(job.future for job in self._waiting)]
                self._waiting.clear()
            for future in pending:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise

    def _take(self, batch: DecodeBatch) -> list[_Job]:
        """Waiting jobs (oldest first, cancelled ones skipped) for the free rows; none
        while rows run if the model's cache cannot take joining rows."""
        if batch.rows and not batch.joinable:
            return []
        jobs: list[_Job] = []
        while self._waiting and len(batch) + len(jobs) < self.capacity:
            job = self._waiting.popleft()
            if job.future.set_running_or_notify_cancel() and not job.request.abandoned:
                jobs.append(job)
        return jobs

    def _admit(
        self,
        batch: DecodeBatch,
        jobs: list[_Job],
        futures: dict[DecodeRequest, Future[SampleResult]],
    ) -> None:
        if batch.rows:
            self.stats.joined_running += len(jobs)
        batch.admit([job.request for job in jobs])
        futures.update((job.request, job.future) for job in jobs)
        self.stats.prefills += 1
        self.stats.peak_rows = max(self.stats.peak_rows, len(batch))


def _seeds(generator: torch.Generator, count: int) -> list[int]:
    """``count`` 62-bit seeds from ``generator``."""
    seeds = torch.randint(0, 2**62, (count,), generator=generator, device=generator.device)
    return [int(seed) for seed in seeds.tolist()]
