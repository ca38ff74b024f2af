"""Continuous batching: one decode loop per model, which requests join at every step.

:class:`ContinuousBatcher` runs a :class:`~envloop.models.generation.decode_loop.DecodeBatch`
on its own thread while there is work. Each step, before the model runs, it admits waiting
requests (first come, first served) up to ``capacity`` rows; a row that finishes frees its
place at once, so a long response never holds back the requests behind it. Requests are
submitted from any thread and answered through ``concurrent.futures.Future``; a batch
submitted in one call is admitted in its order, so with the same arrivals the same rows
share the same steps.

New weights never stop the loop: :meth:`ContinuousBatcher.update` applies them between two
steps (at once while the loop is idle). Rows in flight keep their tokens and go on under
the new weights, with their KV caches kept or recomputed from the new weights.
"""

from __future__ import annotations

import contextlib
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
    weight_updates: int = 0
    """Weight updates applied."""
    recomputed_rows: int = 0
    """Running rows whose caches were rebuilt from new weights (``recompute_on_update``)."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _Job:
    request: DecodeRequest
    future: Future[SampleResult]


@dataclass(eq=False)
class _Update:
    apply: Callable[[], None]
    """Changes the model's weights in place."""
    version: int
    future: Future[None]


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
        recompute_on_update: after a weight update, rebuild each running row's cache and
            next-token logits from the new weights (:meth:`DecodeBatch.recompute`) instead
            of keeping them.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: DecodeSettings,
        generator: torch.Generator,
        capacity: int,
        on_step: Callable[[int], None],
        recompute_on_update: bool = False,
    ) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.generator, self.capacity, self.on_step = generator, capacity, on_step
        self.recompute_on_update = recompute_on_update
        self.version = 0
        """The policy version of the weights the model holds (set by :meth:`update`)."""
        self.stats = DecodeStats()
        self._token_bytes = TokenBytes(tokenizer)
        self._lock = threading.Lock()
        self._update_queued = threading.Condition(self._lock)
        self._waiting: deque[_Job] = deque()
        self._updates: deque[_Update] = deque()
        self._running = False
        self._thread: threading.Thread | None = None
        self._batch: DecodeBatch | None = None

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
                self._thread = threading.Thread(
                    target=self._loop, name="envloop-decode", daemon=True
                )
                self._thread.start()
        return [(job.request, job.future) for job in jobs]

    def update(self, apply: Callable[[], None], version: int) -> Future[None]:
        """Have ``apply`` change the model's weights (in place) between two decode steps,
        and tokens drawn from logits computed afterwards count as ``version``.

        While the loop runs, the update waits for the end of its current step and is
        applied on its thread before the next one (before any waiting row is admitted);
        while it is idle, at once, under the lock (no loop starts meanwhile); called on the
        loop's own thread (from ``on_step``, which runs between two steps), at once. The
        running rows keep their tokens; their caches are kept, or rebuilt from the new
        weights with ``recompute_on_update``. Returns a future done once the update is
        applied (it holds the exception if applying it failed). Updates apply in the order
        of the calls.
        """
        update = _Update(apply, version, Future())
        if threading.current_thread() is self._thread:
            with self._lock:
                self._updates.append(update)  # after those queued before it
            while queued := self._next_update():
                self._apply(queued, self._batch)  # on an error the rest stay queued
            return update.future
        with self._lock:
            if self._running:
                self._updates.append(update)
                self._update_queued.notify_all()
            else:
                self._apply(update, None)
        return update.future

    def _next_update(self) -> _Update | None:
        with self._lock:
            return self._updates.popleft() if self._updates else None

    def wait_for_update(self, timeout: float) -> bool:
        """Block until an update queued by :meth:`update` waits for the loop, or until
        ``timeout`` seconds pass; whether one waits. A hook on the loop's thread (``on_step``)
        that waits for it lands the update right after that step."""
        with self._lock:
            return self._update_queued.wait_for(lambda: bool(self._updates), timeout)

    def _loop(self) -> None:
        batch = self._batch = DecodeBatch(self.model, self.settings, self.version)
        futures: dict[DecodeRequest, Future[SampleResult]] = {}
        try:
            with torch.no_grad():
                while True:
                    with self._lock:
                        update = self._updates.popleft() if self._updates else None
                        joining = [] if update else self._take(batch)
                        if not update and not joining and not batch.rows:
                            self._running = False
                            return
                    if update:
                        self._apply(update, batch)
                        continue  # rows waiting now are admitted under the new weights
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
                self._apply_when_stopped()
            for future in pending:
                if not future.done():
                    future.set_exception(error)
            if not isinstance(error, Exception):
                raise

    def _apply(self, update: _Update, batch: DecodeBatch | None) -> None:
        """Apply ``update`` between two steps of ``batch`` (None: no loop runs), then keep
        or rebuild the running rows' caches. An error goes to the update's future and on
        (the model's state is then unknown)."""
        try:
            update.apply()
            self.version = update.version
            self.stats.weight_updates += 1
            if batch is not None:
                batch.version = update.version
                if self.recompute_on_update:
                    batch.recompute()
                    self.stats.recomputed_rows += len(batch)
        except BaseException as error:
            update.future.set_exception(error)
            raise
        update.future.set_result(None)

    def _apply_when_stopped(self) -> None:
        """Apply the updates queued for a loop that stopped on an error (under the lock)."""
        while self._updates:
            with contextlib.suppress(Exception):  # its future holds the error
                self._apply(self._updates.popleft(), None)

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
