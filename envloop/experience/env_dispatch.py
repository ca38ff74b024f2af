"""Step environments for a rollout; failures become per-sample data.

One path serves every kind of call. :meth:`EnvDispatcher.astep` steps one task's
environment on some samples with one call (``step``, or ``step_stream`` for an environment
that hands back each sample as it finishes; on a Ray actor or in process, see
:mod:`envloop.experience.env_calls`) and delivers each result as it comes, with the timeout,
the retries after an actor restart, the contract checks and the error policy. The sync engine
steps every task group of a turn at once through :meth:`EnvDispatcher.step` (the same path,
on an event loop of its own); the async engine awaits :meth:`EnvDispatcher.astep` on its
own loop.

A step that raises or times out fails the samples it has not delivered; a step that returns
``errors`` (e.g. a :class:`~envloop.environments.sample_environment.SampleEnvironment` whose
method raised on one sample), or a NaN or infinite reward for a sample, fails only those
samples: each becomes a one-sample group with its error.

Every wait is bounded: an actor's start-up by the start-up timeout (an environment that does
not start in time fails its samples), a step by the step timeout (a retry after an actor
restart gets a timeout of its own). An actor whose step timed out is restarted before it
serves another step (:mod:`envloop.experience.env_actors`); an in-process step that timed
out is abandoned on a daemon thread, which never keeps the interpreter from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import traceback
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from ray.exceptions import RayActorError, RayTaskError

from envloop.distributed.daemon_threads import DaemonThreadPool
from envloop.distributed.ray_utils import is_actor
from envloop.environments.contract import (
    NONFINITE_HINT,
    coerce_env_return,
    env_return_problems,
    nonfinite_rewards,
)
from envloop.environments.interfaces import EnvironmentReturn
from envloop.environments.registry import unknown_name_message
from envloop.experience.env_actors import StartGate
from envloop.experience.env_calls import (
    ActorTimeout,
    Item,
    actor_step,
    actor_step_stream,
    thread_step,
    thread_step_stream,
)
from envloop.experience.rollout_options import RolloutSettings

DEFAULT_STARTUP_TIMEOUT_S: float = RolloutSettings.model_fields["env_startup_timeout_s"].default

T = TypeVar("T")


class EnvironmentStepError(RuntimeError):
    """An environment's ``step`` failed and the rollout runs with ``on_env_error="raise"``."""


@dataclass
class GroupResult:
    """One task group's step: its batch indices, and either a result or an error text."""

    task_name: str
    indices: list[int]
    result: EnvironmentReturn | None = None
    error: str | None = None


def group_by_task(task_names: list[str], indices: list[int]) -> dict[str, list[int]]:
    """``indices`` grouped by their task name, groups and members in order of appearance."""
    groups: dict[str, list[int]] = {}
    for i in indices:
        groups.setdefault(task_names[i], []).append(i)
    return groups


def check_tasks_have_envs(task_names: list[str], task_to_env: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first task with no environment, and the known ones."""
    for name in dict.fromkeys(task_names):
        if name not in task_to_env:
            raise ValueError(unknown_name_message("environment for task", name, list(task_to_env)))


class EnvDispatcher:
    """Runs environment steps for a rollout; holds the threads of in-process steps.

    ``max_threads`` bounds the in-process steps that :meth:`astep` runs at once on one event
    loop (None: no bound); a step abandoned at its timeout frees its place at once, its
    daemon thread running on outside the bound."""

    def __init__(
        self,
        task_to_env: dict[str, Any],
        timeout_s: float | None = None,
        on_error: str = "record",
        max_retries: int = 1,
        startup_timeout_s: float | None = DEFAULT_STARTUP_TIMEOUT_S,
        max_threads: int | None = None,
    ) -> None:
        self.task_to_env = task_to_env
        self.timeout_s = _limit(timeout_s)
        self.startup_timeout_s = _limit(startup_timeout_s)
        self.on_error = on_error
        self.max_retries = max_retries
        self.max_threads = max_threads
        self._pool: DaemonThreadPool | None = None
        self._places: asyncio.Semaphore | None = None
        self._gate = StartGate(self.startup_timeout_s)
        self._not_started: dict[str, str] = {}  # task -> why its samples fail
        self.retries = 0  # calls sent again after their actor died (a crash, a node lost)

    @classmethod
    def from_options(
        cls, task_to_env: dict[str, Any], options: Any, max_threads: int | None = None
    ) -> EnvDispatcher:
        """A dispatcher with the timeouts, error policy and retries of rollout ``options``
        (:class:`~envloop.experience.rollout_options.RolloutSettings`)."""
        return cls(
            task_to_env, options.env_step_timeout_s, options.on_env_error,
            options.env_max_retries, options.env_startup_timeout_s, max_threads,
        )  # fmt: skip

    def step(
        self, groups: dict[str, list[int]], env_logs: list[list[dict]], metadata: list[Any]
    ) -> list[GroupResult]:
        """Step each group's environment on its samples' logs and metadata, concurrently
        (first waiting for new actors to start, unless :meth:`wait_until_started` did): the
        results of each group, groups in order. The groups of an environment that did not
        start in time fail at once."""
        self.wait_until_started(groups)
        return run_blocking(self._step_groups(groups, env_logs, metadata))

    def step_stream(
        self,
        task: str,
        samples: list[int],
        env_logs: list[list[dict]],
        metadata: list[Any],
        deliver: Callable[[GroupResult], None],
    ) -> None:
        """:meth:`astep`, from a caller without an event loop (blocks until it is done)."""
        self.wait_until_started({task: samples})
        run_blocking(self.astep(task, samples, env_logs, metadata, deliver))

    def streams(self, task: str) -> bool:
        """Whether ``task``'s environment hands back each sample as it finishes
        (``step_stream``, as every :class:`SampleEnvironment` does, in process or as an
        actor)."""
        return hasattr(self.task_to_env[task], "step_stream")

    async def astep(
        self,
        task: str,
        samples: list[int],
        env_logs: list[list[dict]],
        metadata: list[Any],
        deliver: Callable[[GroupResult], None],
    ) -> None:
        """Step ``task``'s environment on ``samples`` with one call and ``deliver`` each
        result the moment it comes (all at once from a batched ``step``, one by one from
        ``step_stream``): contract checks and ``errors`` per sample; a call that raises or
        times out fails the samples not delivered yet; a call whose actor died is sent again
        for those (``max_retries``) once Ray has restarted the actor. New actors are waited
        for first (bounded by the start-up timeout)."""
        await self._started(task)
        left = list(range(len(samples)))
        for attempt in range(self.max_retries + 1):
            rows = list(left)  # this attempt's call steps these, in this order
            try:
                if task in self._not_started:
                    raise _NotStarted(self._not_started[task])
                async with self._place(task):
                    async for positions, value in self._call(
                        task, rows, samples, env_logs, metadata
                    ):
                        done = [rows[p] for p in positions]
                        for row in done:
                            left.remove(row)
                        result = GroupResult(task, [samples[r] for r in done])
                        try:
                            result.result = _validated(task, value, len(done))
                        except _ContractError as exc:
                            result.error = self._failure(task, exc)
                        for part in self._split_sample_errors(result):
                            deliver(part)
                return
            except EnvironmentStepError:  # on_error="raise": a sample's error, as it is
                raise
            except Exception as exc:
                if attempt < self.max_retries and isinstance(exc, RayActorError):
                    self.retries += 1
                    await asyncio.to_thread(self._await_restart, task)
                    continue
                error = self._failure(task, exc)
                deliver(GroupResult(task, [samples[r] for r in left], error=error))
                return

    def shutdown(self) -> None:
        """Stop the thread pool without waiting for steps that overran their timeout (their
        daemon threads end with the process)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def wait_until_started(self, groups: dict[str, list[int]]) -> None:
        """Wait for the constructors of the groups' actors not known started, so start-up
        never counts against the step timeout (nor in the step's timing); each actor at most
        ``startup_timeout_s`` from the first wait for it. The steps of an environment that
        has not started by then fail with an error naming it (until it does start).

        A constructor that raised surfaces on the group's first step, as that step's error.
        """
        actors = {t: self.task_to_env[t] for t in groups if is_actor(self.task_to_env[t])}
        late = self._gate.wait(list(actors.values()))  # at once for an actor already late
        for task, actor in actors.items():
            if actor._actor_id.binary() not in late:
                self._not_started.pop(task, None)  # started, perhaps after its deadline
            else:
                self._not_started[task] = (
                    f"env {task} did not start within env_startup_timeout_s="
                    f"{self.startup_timeout_s} s (its actor's constructor is still running); "
                    "raise env_startup_timeout_s if it needs longer, or fix what it waits for"
                )

    async def _started(self, task: str) -> None:
        """:meth:`wait_until_started` for ``task``, on a thread when its actor is not known
        started (the event loop never blocks on a constructor)."""
        env = self.task_to_env[task]
        if is_actor(env) and not self._gate.known_started(env):
            await asyncio.to_thread(self.wait_until_started, {task: []})

    async def _step_groups(
        self, groups: dict[str, list[int]], env_logs: list[list[dict]], metadata: list[Any]
    ) -> list[GroupResult]:
        delivered: dict[str, list[GroupResult]] = {task: [] for task in groups}
        calls = [
            asyncio.ensure_future(self.astep(task, idx, env_logs, metadata, delivered[task].append))
            for task, idx in groups.items()
        ]
        try:
            await asyncio.gather(*calls)
        finally:  # on_error="raise": the first error ends the others
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        return [result for task in groups for result in delivered[task]]

    def _place(self, task: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """A place among the ``max_threads`` in-process steps (none needed for an actor)."""
        if self.max_threads is None or is_actor(self.task_to_env[task]):
            return contextlib.nullcontext()
        if self._places is None:
            self._places = asyncio.Semaphore(self.max_threads)
        return self._places

    def _call(
        self,
        task: str,
        rows: list[int],
        samples: list[int],
        env_logs: list[list[dict]],
        metadata: list[Any],
    ) -> AsyncIterator[Item]:
        """One call of ``task``'s environment on the samples at ``rows``, with a deadline of
        its own: its items as they come."""
        env = self.task_to_env[task]
        logs = [env_logs[samples[r]] for r in rows]
        mds = [metadata[samples[r]] for r in rows]
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        if is_actor(env):
            if self.streams(task):
                return actor_step_stream(env, logs, mds, deadline)
            return actor_step(env, logs, mds, deadline)
        if self.streams(task):
            return thread_step_stream(env, logs, mds, deadline)
        if self._pool is None:
            self._pool = DaemonThreadPool(None, "envloop-env")
        return thread_step(self._pool, env, logs, mds, deadline)

    def _await_restart(self, task: str) -> None:
        """``task``'s actor died: wait (bounded) for Ray to restart it before a retry (an
        in-process environment that lost an actor of its own retries at once)."""
        if is_actor(self.task_to_env[task]):
            self._gate.forget(self.task_to_env[task])
            self.wait_until_started({task: []})

    def _split_sample_errors(self, group: GroupResult) -> list[GroupResult]:
        """``group`` as is when its result has no per-sample ``errors``; else the samples
        that succeeded as one group (rows selected) and each failed sample as a group of
        its own with ``"env <task>: <error>"`` (raised with ``on_error="raise"``)."""
        ret, task = group.result, group.task_name
        errors = ret.errors if ret is not None else None
        if ret is None or errors is None or all(e is None for e in errors):
            return [group]
        failed = [
            GroupResult(task, [i], error=f"env {task}: {e}")
            for i, e in zip(group.indices, errors)
            if e is not None
        ]
        if self.on_error == "raise":
            raise EnvironmentStepError(failed[0].error)
        ok = [j for j, e in enumerate(errors) if e is None]
        if not ok:
            return failed
        return [GroupResult(task, [group.indices[j] for j in ok], select_rows(ret, ok)), *failed]

    def _failure(self, task: str, exc: BaseException) -> str:
        """The error text of ``exc`` for ``task``'s samples (raised as
        :class:`EnvironmentStepError` with ``on_error="raise"``)."""
        if isinstance(exc, ActorTimeout):
            text = (
                f"env {task}.step timed out after {self.timeout_s} s; its actor was killed for "
                "Ray to restart (Ray cannot stop a running step, and later steps would queue "
                "behind it)"
            )
        elif isinstance(exc, TimeoutError):
            text = f"env {task}.step timed out after {self.timeout_s} s"
        elif isinstance(exc, (_ContractError, _NotStarted)):
            text = str(exc)
        else:
            text = f"env {task}.step raised:\n{_format_exception(exc)}"
        if self.on_error == "raise":
            raise EnvironmentStepError(text) from exc
        return text


class _ContractError(ValueError):
    pass


class _NotStarted(RuntimeError):
    pass


def run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end on an event loop of its own and return what it returns: in
    this thread, or in a helper thread when this thread runs an event loop already."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_on_new_loop(work)
    with ThreadPoolExecutor(1, thread_name_prefix="envloop-env-loop") as thread:
        return thread.submit(_run_on_new_loop, work).result()


def _run_on_new_loop(work: Coroutine[Any, Any, T]) -> T:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(work)
    finally:
        loop.close()


def _limit(seconds: float | None) -> float | None:
    """An infinite limit is no limit (Ray's and the clock's waits take finite seconds)."""
    return seconds if seconds is not None and math.isfinite(seconds) else None


def _validated(task: str, value: Any, n: int) -> EnvironmentReturn:
    """``value`` as an ``EnvironmentReturn`` for ``n`` samples; a broken structure raises
    ``_ContractError``, a NaN or infinite reward fails its sample (in ``errors``)."""
    try:
        ret = coerce_env_return(value)
    except TypeError as exc:
        raise _ContractError(f"env {task}.step: {exc}") from exc
    problems = env_return_problems(ret, n)
    if problems:
        raise _ContractError(
            f"env {task}.step broke the EnvironmentReturn contract: " + "; ".join(problems)
        )
    bad = nonfinite_rewards(ret)
    if not bad:
        return ret
    errors: list[str | None] = list(ret.errors) if ret.errors is not None else [None] * n
    for i, what in bad.items():
        errors[i] = errors[i] or (
            f"step broke the EnvironmentReturn contract for this sample: {what}; {NONFINITE_HINT}"
        )
    return ret._replace(errors=errors)


def select_rows(ret: EnvironmentReturn, rows: list[int]) -> EnvironmentReturn:
    """``ret`` reduced to the samples at ``rows`` (in that order), with no ``errors``.

    >>> import torch
    >>> ret = EnvironmentReturn([{"role": "user", "content": c} for c in "ab"], [1, 2],
    ...                         [None, None], {"reward/x": torch.tensor([0.5, 1.0])},
    ...                         torch.tensor([False, True]), errors=["boom", None])
    >>> picked = select_rows(ret, [1])
    >>> picked.observations, picked.rewards, picked.terminateds, picked.errors
    ([{'role': 'user', 'content': 'b'}], {'reward/x': tensor([1.])}, tensor([True]), None)
    """
    index = torch.tensor(rows, dtype=torch.long)
    rewards = ret.rewards
    return EnvironmentReturn(
        observations=[ret.observations[j] for j in rows],
        metadata=[ret.metadata[j] for j in rows],
        next_stop_strings=[ret.next_stop_strings[j] for j in rows],
        rewards={k: v[index] for k, v in rewards.items()}
        if isinstance(rewards, dict)
        else rewards[index],
        terminateds=ret.terminateds[index],
        answers=None if ret.answers is None else [ret.answers[j] for j in rows],
    )


def _format_exception(exc: BaseException) -> str:
    if isinstance(exc, RayTaskError):
        return str(exc)  # already holds the remote traceback
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
