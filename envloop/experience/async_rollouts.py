"""The async engine: every sample runs its own turn loop (docs/contract.md, "Rollout
semantics"), built from the same steps as the sync engine.

A sample generates, steps its environment, takes its observation and generates again the
moment its own previous step is done; nothing waits for the slowest sample of a batch.
Samples that reach a stage close together share one call: the generation stage and each
task's environment stage wait ``coalesce_window_s`` when idle, then take up to
``max_coalesced_samples`` waiting samples into one batched call. The steps that update the
state are those of :mod:`envloop.experience.rollout_state`, applied to the samples of each
call, so a sample's turns are computed exactly as in ``run_multi_turn_rollout``.

A backend that overrides ``generate_async`` (``HfGeneration`` batches continuously,
``ServerGeneration`` answers per request) gets a call for every coalesced batch as soon as it
forms, while earlier calls still run, and hands each sample back as soon as it finishes.
Responses that come back one after another, from any call, are appended together once a
turn of the event loop brings no new one (or ``max_coalesced_samples`` wait), in one step
(:func:`~envloop.experience.rollout_state.append_response_rows`: one gather, one decode, one
update of the state); results that an environment streams back are taken likewise. An idle
loop so appends a response at its next turn, and a busy one appends many at once: the
bookkeeping of a turn costs about what it costs in the batched loop however the samples
arrive. A backend with only ``generate`` gets one call at a time, in a worker thread (its
sampling state need not be thread-safe). Environment calls run concurrently, several per
task when samples arrive while a call is under way, through the dispatcher's one path
(:meth:`~envloop.experience.env_dispatch.EnvDispatcher.astep`): actor calls are awaited on
the event loop, in-process steps run on threads (never blocking the loop), with the sync
engine's timeouts, retries, contract checks and ``on_env_error``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.env_dispatch import EnvDispatcher, GroupResult, check_tasks_have_envs
from envloop.experience.group_scoring import GroupGate
from envloop.experience.phase_timer import PhaseTimer
from envloop.experience.rollout_metrics import RolloutProgress, rollout_metrics, rollout_progress
from envloop.experience.rollout_options import (
    DEFAULTS,
    AsyncRolloutOptions,
    ObservationFormat,
    OnEnvError,
    options_from_arguments,
)
from envloop.experience.rollout_results import final_rows
from envloop.experience.rollout_state import (
    RolloutState,
    append_response_rows,
    append_responses,
    build_generation_input,
    check_limits,
    media_read_by,
    observation_renderer,
    take_env_results,
)
from envloop.experience.turn_steps import Responses
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["FinishedGroup", "FinishedSample", "RolloutStream", "SampleEngine"]

MAX_ENV_THREADS = 256
"""Most in-process environment steps of one rollout on threads at once (at most one per
sample in flight)."""


@dataclass(frozen=True)
class FinishedSample:
    """One sample whose rollout ended: its position in the input batch and its final row
    (a one-sample batch with the columns ``run_multi_turn_rollout`` returns)."""

    index: int
    batch: BatchedDataDict[Any]


@dataclass(frozen=True)
class FinishedGroup:
    """A GRPO group whose last member ended: its members' input positions (ascending) and
    their final rows, in that order, with the span of policy versions its generated tokens
    came from (-1 for both when no member generated a token)."""

    indices: list[int]
    batch: BatchedDataDict[Any]
    min_policy_version: int = -1
    max_policy_version: int = -1

    @classmethod
    def of(cls, indices: list[int], batch: BatchedDataDict[Any]) -> FinishedGroup:
        """The group of ``batch`` (final rows with ``min_policy_version`` and
        ``max_policy_version`` columns) at ``indices``."""
        low = [v for v in batch["min_policy_version"].tolist() if v >= 0]
        high = max(batch["max_policy_version"].tolist(), default=-1)
        return cls(indices, batch, min(low, default=-1), high)


class RolloutStream:
    """A rollout whose samples are yielded as they finish.

    ``async for sample in RolloutStream(...)`` yields a :class:`FinishedSample` per sample,
    in completion order; ``stream.groups(group_size)`` yields each :class:`FinishedGroup` of
    ``group_size`` consecutive samples (the generations of one prompt, as
    ``repeat_interleave`` lays them out) once its last member finishes. A stream runs once;
    afterwards :meth:`final_batch` and :meth:`metrics` give what
    ``run_multi_turn_rollout`` returns. Arguments and options are those of
    ``run_async_multi_turn_rollout`` (any other keyword fails with a ``ConfigError`` that
    names the closest option). :meth:`stop_admitting` ends it early: the samples already
    started finish and are yielded, the others never start.
    """

    def __init__(
        self,
        policy_generation: GenerationInterface,
        input_batch: BatchedDataDict[Any],
        tokenizer: Any,
        task_to_env: dict[str, Any],
        max_seq_len: int,
        max_rollout_turns: int = 999999,
        greedy: bool = False,
        *,
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
        self.input_batch = input_batch
        self.state = RolloutState.start(input_batch, tokenizer, max_seq_len)
        self.state.vision.reads_images = media_read_by(
            policy_generation, self.options.deduplicate_multimodal_data
        )
        check_tasks_have_envs(self.state.task_names, task_to_env)
        self.timer = PhaseTimer()
        self._regenerated = getattr(policy_generation, "generation_retries", 0)
        self._engine = SampleEngine(
            self.state, policy_generation, tokenizer, task_to_env, max_rollout_turns, greedy,
            self.options, self.timer,
        )  # fmt: skip
        self._started = False
        self._ran = False
        self._admitting = True

    def __aiter__(self) -> AsyncIterator[FinishedSample]:
        return self._samples()

    async def groups(self, group_size: int) -> AsyncIterator[FinishedGroup]:
        """Each group of ``group_size`` consecutive samples as soon as its last member ends,
        in completion order."""
        if not isinstance(group_size, int) or group_size < 1 or self.state.size % group_size:
            raise ValueError(
                f"group_size must be a positive int dividing the batch of {self.state.size} "
                f"samples (generations per prompt), got {group_size!r}"
            )
        left: dict[int, int] = {}
        async for finished in self._finished():
            for index in finished:
                group = index // group_size
                left[group] = left.get(group, group_size) - 1
                if left[group] == 0:
                    indices = list(range(group * group_size, (group + 1) * group_size))
                    yield FinishedGroup.of(indices, self._rows(indices))

    def stop_admitting(self) -> None:
        """Start no more samples: those already started run to their end and are yielded
        (by :meth:`groups`: the groups whose every member started), then the stream ends
        (at once when none has started). Safe to call from a signal
        handler on the event loop's thread (it only sets a flag). A stream that so ended
        before every sample ran has no :meth:`final_batch` or :meth:`metrics` (they
        raise); its samples are the ones it yielded."""
        self._admitting = False

    def final_batch(self) -> BatchedDataDict[Any]:
        """Every sample's final row, in input order (once the stream has run)."""
        self._require_finished()
        return final_rows(self.input_batch, self.state)

    def metrics(self) -> dict[str, Any]:
        """The rollout's metrics, as ``run_multi_turn_rollout`` reports them."""
        self._require_finished()
        metrics = rollout_metrics(self.state, ~self.state.done, self.timer)
        regenerated = getattr(self._engine.policy, "generation_retries", 0) - self._regenerated
        return {
            **metrics,
            "total_env_step_retries": self._engine.dispatcher.retries,
            "total_generation_retries": regenerated,
        }

    async def _samples(self) -> AsyncIterator[FinishedSample]:
        """Each finished sample with its row; the rows of samples that finished together
        are built in one batch and sliced."""
        async for finished in self._finished():
            rows = self._rows(finished)
            for k, index in enumerate(finished):
                yield FinishedSample(index, rows.slice(k, k + 1))

    async def _finished(self) -> AsyncIterator[list[int]]:
        """The samples that ended, in completion order: all those that ended since the
        last item, as each item."""
        if self._started:
            raise RuntimeError("a RolloutStream runs once; start a new one for another rollout")
        self._started = True
        finished: asyncio.Queue[int | BaseException] = asyncio.Queue()
        waiting = deque(range(self.state.size))  # not yet admitted, in input order
        limit = self.options.max_concurrent_samples or self.state.size

        def admit() -> None:
            while self._admitting and waiting and self._engine.in_flight < limit:
                self._engine.begin(waiting.popleft())

        def on_finished(index: int) -> None:
            finished.put_nowait(index)
            admit()

        self._engine.start(on_finished, finished.put_nowait)
        admit()
        left = self.state.size
        try:
            while left and (self._admitting or self._engine.in_flight or not finished.empty()):
                items = [await finished.get()]
                while not finished.empty():
                    items.append(finished.get_nowait())
                indices: list[int] = []
                for item in items:
                    if isinstance(item, BaseException):
                        if indices:
                            yield indices  # those that ended before the error
                        raise item
                    indices.append(item)
                left -= len(indices)
                yield indices
        finally:
            await self._engine.close()
        self._ran = not left

    def _rows(self, indices: list[int]) -> BatchedDataDict[Any]:
        return final_rows(self.input_batch, self.state, indices)

    def _require_finished(self) -> None:
        if not self._ran and not self._admitting:
            raise RuntimeError(
                "the stream stopped admitting samples (stop_admitting) before every sample "
                "ran: its results are the samples it yielded"
            )
        if not self._ran:
            raise RuntimeError("the stream has not run to its end yet; iterate over it first")


class SampleEngine:
    """The stages of an async rollout and the queues between them, over the slots of a
    :class:`RolloutState`. Whoever drives it decides which samples run: :meth:`begin`
    starts the sample in a slot, and the engine calls ``on_finished(slot)`` once the
    sample's rollout has ended (or ``on_error(exception)`` when a stage raised)."""

    def __init__(
        self,
        state: RolloutState,
        policy: GenerationInterface,
        tokenizer: Any,
        task_to_env: dict[str, Any],
        max_turns: int,
        greedy: bool,
        options: AsyncRolloutOptions,
        timer: PhaseTimer,
    ) -> None:
        self.state, self.policy, self.tokenizer = state, policy, tokenizer
        self.max_turns, self.greedy, self.options, self.timer = max_turns, greedy, options, timer
        self.renderer = observation_renderer(tokenizer, options.observation_format)
        limit = max(1, min(options.max_concurrent_samples or state.size, MAX_ENV_THREADS))
        self.dispatcher = EnvDispatcher.from_options(task_to_env, options, max_threads=limit)
        self.streams_outputs = type(policy).generate_async is not GenerationInterface.generate_async
        self.in_flight = 0
        self.closed = False
        self.tasks: set[asyncio.Future[None]] = set()
        self.env_stages: dict[str, _Stage] = {}
        self.admitted: list[int] = []  # begun since the event loop's last turn
        self.groups = GroupGate(
            task_to_env, state, lambda i, eos: self._env_stage(state.task_names[i]).add(i, eos)
        )

    def start(
        self, on_finished: Callable[[int], None], on_error: Callable[[BaseException], None]
    ) -> None:
        """Get ready to run samples (inside the running event loop)."""
        self.on_finished, self.on_error = on_finished, on_error
        self.loop = asyncio.get_running_loop()
        window = self.options.coalesce_window_s
        self.generation = self._stage(self._generate, window, serial=not self.streams_outputs)
        self.responses = self._stage(self._take_streamed_responses, None, serial=True)
        self.results = self._stage(self._take_streamed_results, None, serial=True)

    def begin(self, i: int) -> None:
        """Start the sample in slot ``i`` (loaded into the state) on its first turn."""
        self.in_flight += 1
        self.groups.begin(i)
        if not self.admitted:
            self.loop.call_soon(self._admit)
        self.admitted.append(i)

    async def close(self) -> None:
        """Cancel every stage's call still under way and wait until each has stopped: a
        generation call abandons its rows, an environment call already under way (on an
        actor or a thread) is waited for (``env_step_timeout_s`` bounds it) and its result
        dropped. Then the dispatcher shuts down."""
        self.closed = True
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.dispatcher.shutdown()

    def _stage(
        self, work: Callable[..., Awaitable[None]], window: float | None, *, serial: bool
    ) -> _Stage:
        return _Stage(work, window, self.options.max_coalesced_samples, self._spawn, serial)

    def _admit(self) -> None:
        """Send the samples begun since the last turn of the event loop on, together (an
        event loop callback, whose exceptions would otherwise only be logged)."""
        samples, self.admitted = self.admitted, []
        if self.closed:
            return
        try:
            self._next_turns(samples)
        except BaseException as exc:
            self.on_error(exc)

    def _next_turns(self, samples: list[int]) -> None:
        """Send each of ``samples`` on to its next generation, or out if its rollout ended."""
        index = torch.tensor(samples, dtype=torch.long)
        ended = (self.state.done[index] | (self.state.turns[index] >= self.max_turns)).tolist()
        for i, end in zip(samples, ended):
            if end:
                self.in_flight -= 1
                self.groups.leave(i)
                self.on_finished(i)
            else:
                self.generation.add(i)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.on_error(task.exception())  # type: ignore[arg-type]

    async def _generate(self, samples: list[int]) -> None:
        """Generate for ``samples`` (steps 1-2 of docs/contract.md, "Rollout semantics"). A
        backend that streams hands each row on as it finishes, to be appended with the
        others that come back with it."""
        state, active = self.state, torch.tensor(samples, dtype=torch.long)
        with self.timer.phase("flatten"):
            gen_input = build_generation_input(state, active)
        with self.timer.phase("generation"):
            if not self.streams_outputs:
                output = await asyncio.to_thread(self.policy.generate, gen_input, self.greedy)
                with self.timer.phase("gen_bookkeeping"):
                    responses = append_responses(state, active, gen_input, output, self.tokenizer)
                self._to_environments(samples, responses)
                return
            lengths = gen_input["input_lengths"].tolist()
            budgets = gen_input["max_new_tokens"].tolist()
            async for j, output in self.policy.generate_async(gen_input, greedy=self.greedy):
                self.responses.add(samples[j], lengths[j], budgets[j], output)

    async def _take_streamed_responses(
        self, samples: list[int], lengths: list[int], budgets: list[int], outputs: list[Any]
    ) -> None:
        """Append the responses that came back one after another (each a one-row output)
        in one step, and send their samples on together."""
        with self.timer.phase("gen_bookkeeping"):
            responses = append_response_rows(
                self.state, samples, lengths, budgets, outputs, self.tokenizer
            )
        self._to_environments(samples, responses)

    def _to_environments(self, samples: list[int], responses: Responses) -> None:
        """Each of ``samples`` on to its task's environment, or out if it failed to generate."""
        failed = []
        for i, error, eos in zip(samples, responses.errors, responses.ended_with_eos):
            if error is not None:
                failed.append(i)
            else:
                self.groups.arrive(i, eos)  # held until its group is complete, if it scores groups
        if failed:
            self._next_turns(failed)  # ends them

    def _env_stage(self, task: str) -> _Stage:
        if task not in self.env_stages:
            window = self.options.coalesce_window_s
            self.env_stages[task] = self._stage(self._step_env, window, serial=False)
        return self.env_stages[task]

    async def _step_env(self, samples: list[int], ended_with_eos: list[bool]) -> None:
        """Step one task's environment on ``samples`` (steps 3-6 of docs/contract.md,
        "Rollout semantics"); each result goes on with the other results that come back
        one after another (all of a batched call's at once; a streaming environment's
        (``step_stream``) as each sample finishes). Results that come after the engine
        closed are dropped."""
        state, task = self.state, self.state.task_names[samples[0]]
        eos = dict(zip(samples, ended_with_eos))

        def deliver(result: GroupResult) -> None:
            if not self.closed:
                self.results.add(result, [eos[i] for i in result.indices])

        with self.timer.phase("env_step"):
            await self.dispatcher.astep(task, samples, state.env_views, state.metadata, deliver)

    async def _take_streamed_results(
        self, results: list[GroupResult], ended_with_eos: list[list[bool]]
    ) -> None:
        """Take the environment results that came back one after another in one step."""
        eos = {
            i: e
            for result, flags in zip(results, ended_with_eos)
            for i, e in zip(result.indices, flags)
        }
        self._take_env_results(results, eos)

    def _take_env_results(self, results: list[GroupResult], eos: dict[int, bool]) -> None:
        take_env_results(self.state, results, eos, self.tokenizer, self.renderer, self.timer)
        if self.options.on_turn is not None:
            self.options.on_turn(rollout_progress(self.state, self.timer))
        self._next_turns([i for result in results for i in result.indices])


class _Stage:
    """Items waiting for one kind of work. When idle, a stage waits for more, ``window``
    seconds, or (``window`` None) until a turn of the event loop brings no new item or
    ``limit`` items wait; then it calls ``work`` on up to ``limit`` of them (with the values
    they were added with, a list per value). A ``serial`` stage runs one call at a time,
    and items that arrive during a call go into the next; other stages start a call per
    batch."""

    def __init__(
        self,
        work: Callable[..., Awaitable[None]],
        window: float | None,
        limit: int,
        spawn: Callable[[Awaitable[None]], None],
        serial: bool,
    ) -> None:
        self.work, self.window, self.limit, self.spawn = work, window, limit, spawn
        self.serial = serial
        self.waiting: list[tuple[Any, ...]] = []
        self.scheduled = False

    def add(self, *item: Any) -> None:
        self.waiting.append(item)
        if not self.scheduled:
            self.scheduled = True
            self.spawn(self._drain())

    async def _drain(self) -> None:
        await self._gather()
        try:
            while self.waiting:
                batch = self.waiting[: self._share()]
                del self.waiting[: len(batch)]
                call = self.work(*[list(column) for column in zip(*batch)])
                if self.serial:
                    await call
                else:
                    self.spawn(call)
        finally:
            self.scheduled = False

    def _share(self) -> int:
        """How many waiting items the next call takes: the fewest calls of at most
        ``limit`` items, equal in size (700 waiting, limit 256: 234, 233, 233; not 256,
        256, 188), so no call is a small leftover."""
        calls = -(-len(self.waiting) // self.limit)
        return -(-len(self.waiting) // calls)

    async def _gather(self) -> None:
        if self.window is not None:
            await asyncio.sleep(self.window)
            return
        seen = 0
        while seen < len(self.waiting) < self.limit:
            seen = len(self.waiting)
            await asyncio.sleep(0)
