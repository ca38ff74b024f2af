"""``ExperienceStream``: a continuous asynchronous rollout over a prompt source, for
asynchronous RL.

Each prompt of the source runs ``group_size`` times, on the per-sample engine of
:mod:`envloop.experience.async_rollouts` (the same steps as every other engine). The stream
holds a fixed set of sample slots (``max_concurrent_samples``); a prompt's group takes
``group_size`` of them and gives them back the moment its last member ends, so new prompts
start as soon as capacity frees and generation never waits for the consumer, until
``max_buffered_groups`` finished groups wait unconsumed (backpressure).

Staleness: a group's age is the backend's current ``policy_version`` minus the oldest
version among its generated tokens. A group older than ``max_staleness`` when it finishes,
or when it is handed to the consumer, is dropped and its prompt runs again (a
regeneration), so every group the consumer receives is at most ``max_staleness`` versions
old at that moment.

Dynamic sampling (DAPO, ``filter_groups=True``): a group that finishes with no reward
signal (fewer than two valid members, or all valid rewards equal; see
:func:`envloop.algorithms.grpo.filter_informative_groups`) is dropped and its slots admit
the next prompt, so the consumer only receives groups with a nonzero advantage.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envloop.algorithms.grpo import filter_informative_groups
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.async_rollouts import FinishedGroup, SampleEngine
from envloop.experience.env_dispatch import check_tasks_have_envs
from envloop.experience.phase_timer import TIMING_PHASES, PhaseTimer
from envloop.experience.rollout_metrics import RolloutProgress
from envloop.experience.rollout_options import (
    DEFAULTS,
    AsyncRolloutOptions,
    ObservationFormat,
    OnEnvError,
    options_from_arguments,
)
from envloop.experience.rollout_results import grouped_slot_rows
from envloop.experience.rollout_state import RolloutState, check_limits, media_read_by
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["ExperienceStream"]

DEFAULT_MAX_CONCURRENT_SAMPLES = 64
"""Samples in flight when ``max_concurrent_samples`` is not given (rounded down to whole
groups, and at least one group)."""


@dataclass
class _Group:
    """One prompt's generations: where they run and what the consumer gets."""

    number: int  # the prompt's position in the source
    rows: BatchedDataDict[Any]  # group_size input rows (the prompt repeated)
    slots: list[int] = field(default_factory=list)
    left: int = 0  # members still running
    runs: int = 0  # times it was started (1 + regenerations)


@dataclass
class _Running:
    """Count, sum and largest of values seen (constant memory over an endless stream)."""

    count: int = 0
    total: int = 0
    largest: int = 0

    def add(self, value: int) -> None:
        self.count, self.total = self.count + 1, self.total + value
        self.largest = max(self.largest, value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class _Counters:
    groups_yielded: int = 0
    groups_dropped_stale: int = 0
    groups_dropped_uninformative: int = 0
    samples_yielded: int = 0
    failed_samples: int = 0
    turns: int = 0
    generated_tokens: int = 0
    staleness: _Running = field(default_factory=_Running)  # yielded groups' ages
    version_spans: _Running = field(default_factory=_Running)  # their max - min
    generation_wait_s: float = 0.0


class ExperienceStream:
    """Groups of generations over a prompt source, yielded as they finish.

    ``async for group in stream`` yields a :class:`FinishedGroup` per prompt (its
    ``group_size`` final rows, with the columns ``run_multi_turn_rollout`` returns, and the
    span of policy versions they were generated with), in completion order, until the
    source runs out or :meth:`close` is called (``async with ExperienceStream(...) as
    stream:`` closes it however the block ends). ``FinishedGroup.indices`` are the members'
    positions in the source repeated ``group_size`` times (prompt k: ``k*group_size`` to
    ``k*group_size + group_size - 1``). A failed sample (its environment or generation
    failed) is a member of its group with ``loss_multiplier`` 0.

    Args:
        policy_generation: the policy; its ``policy_version`` is read when a group
            finishes and when it is handed over (``update_weights`` moves it).
        prompts: an iterable or async iterable of single ``DatumSpec`` rows (dicts), or a
            ``BatchedDataDict`` (read row by row). Read lazily, one prompt per free group.
        tokenizer, task_to_env, max_seq_len, max_rollout_turns, greedy: as for
            ``run_multi_turn_rollout``.
        group_size: generations per prompt.
        max_staleness: most versions a yielded group's oldest token may lag behind the
            backend's current version (0: strictly on-policy); None: no bound.
        max_buffered_groups: finished groups that may wait unconsumed before no new prompt
            is admitted; None: as many as run at once (``max_concurrent_samples //
            group_size``).
        filter_groups: drop groups without reward signal as they finish and admit more
            prompts in their place (DAPO's dynamic sampling); needs ``group_size >= 2``.
        deduplicate_multimodal_data, observation_format, env_step_timeout_s,
            env_startup_timeout_s, on_env_error, env_max_retries, on_turn,
            max_concurrent_samples, coalesce_window_s, max_coalesced_samples: the options
            of ``run_async_multi_turn_rollout``
            (:class:`~envloop.experience.rollout_options.AsyncRolloutOptions`);
            ``max_concurrent_samples`` None means 64 here. Any other keyword fails with a
            ``ConfigError`` that names the closest option.
    """

    def __init__(
        self,
        policy_generation: GenerationInterface,
        prompts: Iterable[Any] | AsyncIterable[Any],
        tokenizer: Any,
        task_to_env: dict[str, Any],
        max_seq_len: int,
        max_rollout_turns: int = 999999,
        greedy: bool = False,
        *,
        group_size: int = 1,
        max_staleness: int | None = None,
        max_buffered_groups: int | None = None,
        filter_groups: bool = False,
        deduplicate_multimodal_data: bool = False,
        observation_format: ObservationFormat = DEFAULTS.observation_format,
        env_step_timeout_s: float | None = DEFAULTS.env_step_timeout_s,
        env_startup_timeout_s: float | None = DEFAULTS.env_startup_timeout_s,
        on_env_error: OnEnvError = DEFAULTS.on_env_error,
        env_max_retries: int = DEFAULTS.env_max_retries,
        on_turn: Callable[[RolloutProgress], None] | None = None,
        max_concurrent_samples: int | None = DEFAULTS.max_concurrent_samples,
        coalesce_window_s: float = DEFAULTS.coalesce_window_s,
        max_coalesced_samples: int = DEFAULTS.max_coalesced_samples,
        **unknown: Any,
    ) -> None:
        self.options = options_from_arguments(AsyncRolloutOptions, locals(), unknown)
        check_limits(max_seq_len, max_rollout_turns)
        _check_stream_args(group_size, max_staleness, max_buffered_groups, filter_groups)
        concurrent = self.options.max_concurrent_samples or DEFAULT_MAX_CONCURRENT_SAMPLES
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.filter_groups = filter_groups
        self.slots_total = max(1, concurrent // group_size) * group_size
        self.max_buffered_groups = max_buffered_groups or self.slots_total // group_size
        self.policy, self.task_to_env = policy_generation, task_to_env
        self.state = RolloutState.empty(self.slots_total, tokenizer, max_seq_len)
        self.state.vision.reads_images = media_read_by(
            policy_generation, self.options.deduplicate_multimodal_data
        )
        self.timer = PhaseTimer()
        options_here = self.options.model_copy(update={"max_concurrent_samples": self.slots_total})
        self._engine = SampleEngine(
            self.state, policy_generation, tokenizer, task_to_env, max_rollout_turns, greedy,
            options_here, self.timer,
        )  # fmt: skip
        self._source = _prompt_rows(prompts)
        self._free = deque(range(self.slots_total))
        self._by_slot: dict[int, _Group] = {}
        self._ready: deque[_Finished] = deque()
        self._retry: deque[_Group] = deque()
        self._admitted: list[_Group] = []  # given slots since the event loop's last turn
        self._completed: list[_Group] = []  # last member ended since the loop's last turn
        self._running_groups = 0
        self._source_done = False
        self._started = self._closed = False
        self._admitting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._feeder: asyncio.Task[None] | None = None
        self._counters = _Counters()
        self._regenerated_before = getattr(policy_generation, "generation_retries", 0)

    def __aiter__(self) -> AsyncIterator[FinishedGroup]:
        return self

    async def __aenter__(self) -> ExperienceStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def __anext__(self) -> FinishedGroup:
        self._start()
        assert self._changed is not None
        while True:
            if self._closed:
                raise StopAsyncIteration
            if self._error is not None:
                error, self._error = self._error, None
                await self.close()
                raise error
            if self._ready:
                group = self._ready.popleft()
                self._notify()
                if self._is_stale(group):
                    self._regenerate(group)
                    continue
                return self._hand_over(group)
            if self._exhausted():
                await self.close()
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()

    async def close(self) -> None:
        """Stop: cancel what is in flight (generation calls, environment calls) and wait
        until no task of the stream runs; groups not yet yielded are dropped. Idempotent."""
        if self._closed and self._feeder is None:
            return
        self._closed = True
        feeder, self._feeder = self._feeder, None
        if feeder is not None:
            feeder.cancel()
            await asyncio.gather(feeder, return_exceptions=True)
        if self._started:
            await self._engine.close()
        self._notify()

    def stop_admitting(self) -> None:
        """Start no more prompts: the groups already started finish and are yielded (a
        stale one is dropped, not run again), then iteration ends. Safe to call from a
        signal handler or another thread."""
        self._admitting = False
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._notify)

    def metrics(self) -> dict[str, float | int]:
        """What the stream has done so far: ``groups_yielded``, ``groups_dropped_stale``,
        ``regenerations`` (prompts run again because their group was stale),
        ``groups_dropped_uninformative`` (with ``filter_groups``),
        ``samples_yielded``, ``env_or_generation_error_rate`` (failed members among those
        yielded), ``total_turns``, ``total_generated_tokens``, ``mean_staleness`` and
        ``max_staleness`` (versions between a yielded group's oldest token and the
        backend's version when it was handed over), ``mean_version_span`` and
        ``max_version_span`` (newest minus oldest version within a yielded group),
        ``generation_wait_s`` (seconds admission was held because ``max_buffered_groups``
        groups waited for the consumer), ``total_env_step_retries`` (environment calls sent
        again after their actor died), ``total_generation_retries`` (rows generated again
        after the worker actor generating them was lost) and ``timing/<phase>_s``."""
        c = self._counters
        metrics: dict[str, float | int] = {
            "groups_yielded": c.groups_yielded,
            "groups_dropped_stale": c.groups_dropped_stale,
            "regenerations": c.groups_dropped_stale,
            "groups_dropped_uninformative": c.groups_dropped_uninformative,
            "samples_yielded": c.samples_yielded,
            "env_or_generation_error_rate": c.failed_samples / max(c.samples_yielded, 1),
            "total_turns": c.turns,
            "total_generated_tokens": c.generated_tokens,
            "mean_staleness": c.staleness.mean,
            "max_staleness": c.staleness.largest,
            "mean_version_span": c.version_spans.mean,
            "max_version_span": c.version_spans.largest,
            "generation_wait_s": c.generation_wait_s,
            "total_env_step_retries": self._engine.dispatcher.retries,
            "total_generation_retries": self._generation_retries(),
        }
        for name in TIMING_PHASES:
            metrics[f"timing/{name}_s"] = self.timer.seconds.get(name, 0.0)
        return metrics

    def _generation_retries(self) -> int:
        return getattr(self.policy, "generation_retries", 0) - self._regenerated_before

    # -- admission -------------------------------------------------------------------

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._engine.start(self._member_finished, self._fail)
        self._feeder = asyncio.ensure_future(self._feed())

    async def _feed(self) -> None:
        """Admit groups (regenerations first, then new prompts) while there is room."""
        assert self._changed is not None
        number = 0
        while True:
            await self._wait_for_room()
            if not self._admitting:
                return
            if self._retry:
                self._begin(self._retry.popleft())
                continue
            try:
                datum = await anext(self._source)
            except StopAsyncIteration:
                self._source_done = True
                self._notify()
                await self._wait_for_retry()
                continue
            except Exception as exc:
                self._fail(exc)
                return
            if not self._admitting:
                return
            try:
                rows = _group_rows(datum, self.group_size, number)
                self._begin(_Group(number, rows))
            except Exception as exc:
                self._fail(exc)
                return
            number += 1

    async def _wait_for_room(self) -> None:
        assert self._changed is not None
        held_since = None
        while self._admitting and not self._has_room():
            if held_since is None and len(self._ready) >= self.max_buffered_groups:
                held_since = time.perf_counter()
            self._changed.clear()
            await self._changed.wait()
        if held_since is not None:
            self._counters.generation_wait_s += time.perf_counter() - held_since

    async def _wait_for_retry(self) -> None:
        assert self._changed is not None
        while self._admitting and not self._retry:
            self._changed.clear()
            await self._changed.wait()

    def _has_room(self) -> bool:
        free_group = len(self._free) >= self.group_size
        return free_group and len(self._ready) < self.max_buffered_groups

    def _begin(self, group: _Group) -> None:
        """Give ``group`` free slots; its members start at the event loop's next turn,
        loaded together with the other groups admitted in this one."""
        if "task_name" in group.rows:
            check_tasks_have_envs(list(group.rows["task_name"]), self.task_to_env)
        group.slots = [self._free.popleft() for _ in range(self.group_size)]
        group.left, group.runs = self.group_size, group.runs + 1
        self._running_groups += 1
        if not self._admitted:
            asyncio.get_running_loop().call_soon(self._start_admitted)
        self._admitted.append(group)

    def _start_admitted(self) -> None:
        """Load the groups admitted since the event loop's last turn into their slots in
        one step and start their members (an event loop callback: errors go to the
        consumer)."""
        groups, self._admitted = self._admitted, []
        if self._closed:
            return
        try:
            self._load(groups)
        except Exception as exc:
            self._fail(exc)
            return
        for group in groups:
            for slot in group.slots:
                self._by_slot[slot] = group
                self._engine.begin(slot)

    def _load(self, groups: list[_Group]) -> None:
        """Load ``groups``' rows into their slots; a bad prompt's error names it."""
        rows = [group.rows for group in groups]
        if all("message_log" in row and "task_name" in row for row in rows):
            slots = [slot for group in groups for slot in group.slots]
            try:
                self.state.load(slots, _load_rows(rows))
                return
            except ValueError:
                pass
        for group in groups:  # one at a time, to name the bad prompt
            try:
                self.state.load(group.slots, group.rows)
            except ValueError as exc:
                raise ValueError(f"prompt {group.number} of the stream's source: {exc}") from exc

    # -- finishing ------------------------------------------------------------------

    def _member_finished(self, slot: int) -> None:
        group = self._by_slot.pop(slot)
        group.left -= 1
        if group.left:
            return
        if not self._completed:
            asyncio.get_running_loop().call_soon(self._finish_completed)
        self._completed.append(group)

    def _finish_completed(self) -> None:
        """Take the rows of the groups whose last member ended since the event loop's last
        turn, in one step, and free their slots (an event loop callback: errors go to the
        consumer)."""
        groups, self._completed = self._completed, []
        if self._closed:
            return
        try:
            inputs = [group.rows.copy() for group in groups]
            slots = [group.slots for group in groups]
            results = grouped_slot_rows(inputs, self.state, slots, own_components=True)
            flat = np.asarray([slot for group in groups for slot in group.slots])
            starts = np.arange(len(groups)) * self.group_size
            tokens = np.add.reduceat(self.state.gen_tokens.numpy()[flat], starts).tolist()
            turns = np.add.reduceat(self.state.turns.numpy()[flat], starts).tolist()
        except Exception as exc:
            self._fail(exc)
            return
        for k, (group, rows) in enumerate(zip(groups, results)):
            self._running_groups -= 1
            result = FinishedGroup.of(self._member_indices(group), rows)
            finished = _Finished(group, result, tokens[k], turns[k])
            self._free.extend(group.slots)
            if self._is_stale(finished):
                self._regenerate(finished)
            elif (
                self.filter_groups
                and filter_informative_groups(rows, self.group_size).dropped_groups
            ):
                self._counters.groups_dropped_uninformative += 1
            else:
                self._ready.append(finished)
        self._notify()

    def _is_stale(self, finished: _Finished) -> bool:
        if self.max_staleness is None:
            return False
        oldest = finished.result.min_policy_version
        return oldest >= 0 and self.policy.policy_version - oldest > self.max_staleness

    def _regenerate(self, finished: _Finished) -> None:
        self._counters.groups_dropped_stale += 1
        self._retry.append(finished.group)
        self._notify()

    def _hand_over(self, finished: _Finished) -> FinishedGroup:
        result, c = finished.result, self._counters
        batch = result.batch
        c.groups_yielded += 1
        c.samples_yielded += len(result.indices)
        errors = zip(batch["env_error"], batch["generation_error"])
        c.failed_samples += sum(e is not None or g is not None for e, g in errors)
        c.turns += finished.turns
        c.generated_tokens += finished.generated_tokens
        if result.min_policy_version >= 0:
            c.staleness.add(self.policy.policy_version - result.min_policy_version)
            c.version_spans.add(result.max_policy_version - result.min_policy_version)
        return result

    def _member_indices(self, group: _Group) -> list[int]:
        first = group.number * self.group_size
        return list(range(first, first + self.group_size))

    def _exhausted(self) -> bool:
        no_more = not self._admitting or (self._source_done and not self._retry)
        return no_more and not self._running_groups and not self._ready

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._notify()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()


@dataclass
class _Finished:
    """A group whose members all ended, waiting for the consumer."""

    group: _Group
    result: FinishedGroup
    generated_tokens: int  # by its members, summed
    turns: int  # of its members, summed


_LOADED_COLUMNS = ("message_log", "task_name", "stop_strings", "extra_env_info")
"""The input columns ``RolloutState.load`` reads."""


def _load_rows(rows: list[BatchedDataDict[Any]]) -> BatchedDataDict[Any]:
    """The columns of ``rows`` that ``RolloutState.load`` reads, laid end to end (a column
    some rows lack is None there, as ``load`` reads a missing one)."""
    merged: dict[str, list[Any]] = {}
    for key in _LOADED_COLUMNS:
        if any(key in row for row in rows):
            merged[key] = [v for row in rows for v in (row.get(key) or [None] * row.size)]
    return BatchedDataDict(merged)


def _group_rows(datum: Any, group_size: int, number: int) -> BatchedDataDict[Any]:
    """``datum`` (a ``DatumSpec`` dict or a one-row batch) as ``group_size`` input rows."""
    if isinstance(datum, BatchedDataDict):
        row = datum
    elif isinstance(datum, dict):
        row = BatchedDataDict({key: [value] for key, value in datum.items()})
    else:
        raise TypeError(
            f"prompt {number} of the stream's source is a {type(datum).__name__}; give "
            "DatumSpec dicts (message_log, task_name, ...) or a BatchedDataDict."
        )
    if isinstance(datum, BatchedDataDict) and row.size != 1:
        raise ValueError(f"prompt {number} of the stream's source has {row.size} rows; give one")
    # Several members get their own copies of the row's lists (repeat_interleave deep-copies
    # them) and share its media (images, vision inputs: never written to); a lone member
    # shares everything with the source, as a RolloutStream row does.
    return row if group_size == 1 else row.repeat_interleave(group_size, share_immutable_media=True)


async def _prompt_rows(prompts: Any) -> AsyncIterator[Any]:
    """The prompts one at a time: a ``BatchedDataDict``'s rows, or an (async) iterable's
    items."""
    if isinstance(prompts, BatchedDataDict):
        for i in range(prompts.size):
            yield prompts.select_indices([i])
    elif isinstance(prompts, AsyncIterable):
        async for datum in prompts:
            yield datum
    elif isinstance(prompts, Iterable) and not isinstance(prompts, (str, bytes, dict)):
        for datum in prompts:
            yield datum
    else:
        raise TypeError(
            f"prompts is a {type(prompts).__name__}; give an iterable or async iterable of "
            "DatumSpec dicts, or a BatchedDataDict."
        )


def _check_stream_args(
    group_size: Any, max_staleness: Any, max_buffered_groups: Any, filter_groups: Any
) -> None:
    problems = []
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        problems.append(f"group_size must be an int >= 1, got {group_size!r}")
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        problems.append(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")
    if max_buffered_groups is not None and (
        isinstance(max_buffered_groups, bool)
        or not isinstance(max_buffered_groups, int)
        or max_buffered_groups < 1
    ):
        problems.append(
            f"max_buffered_groups must be None or an int >= 1, got {max_buffered_groups!r}"
        )
    if not isinstance(filter_groups, bool):
        problems.append(f"filter_groups must be True or False, got {filter_groups!r}")
    elif filter_groups and isinstance(group_size, int) and group_size < 2:
        problems.append(
            f"filter_groups=True needs group_size >= 2 (got {group_size}): a group of one "
            "has no reward signal to keep"
        )
    if problems:
        raise ValueError("Invalid ExperienceStream arguments: " + "; ".join(problems))
