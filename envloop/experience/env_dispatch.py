"""Step every task group's environment concurrently; failures become per-sample data.

One call per environment per turn: samples are grouped by ``task_name``, every group's
``step`` is started at once (a Ray actor call, or a thread for an in-process environment),
and the results are collected against one deadline. A step that raises or times out fails
its whole group; a step that returns ``errors`` (e.g. a
:class:`~envloop.environments.sample_environment.SampleEnvironment` whose method raised on
one sample), or a NaN or infinite reward for a sample, fails only those samples: each
becomes a one-sample group with its error.

Every wait is bounded: an actor's start-up by the start-up timeout (an environment that does
not start in time fails its samples), a step by the step timeout. An actor whose step timed
out is restarted before it serves another step (:mod:`envloop.experience.env_actors`); an
in-process step that timed out is abandoned on a daemon thread, which never keeps the
interpreter from exiting.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

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
from envloop.experience.env_actors import StartGate, retire_stuck_actor
from envloop.experience.rollout_options import RolloutSettings

DEFAULT_STARTUP_TIMEOUT_S: float = RolloutSettings.model_fields["env_startup_timeout_s"].default


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
    """Runs environment steps for a rollout; holds the thread pool for in-process envs."""

    def __init__(
        self,
        task_to_env: dict[str, Any],
        timeout_s: float | None = None,
        on_error: str = "record",
        max_retries: int = 1,
        startup_timeout_s: float | None = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> None:
        self.task_to_env = task_to_env
        self.timeout_s = _limit(timeout_s)
        self.startup_timeout_s = _limit(startup_timeout_s)
        self.on_error = on_error
        self.max_retries = max_retries
        self._pool: DaemonThreadPool | None = None
        self._gate = StartGate(self.startup_timeout_s)
        self._not_started: dict[str, str] = {}  # task -> why its samples fail

    @classmethod
    def from_options(cls, task_to_env: dict[str, Any], options: Any) -> EnvDispatcher:
        """A dispatcher with the timeouts, error policy and retries of rollout ``options``
        (:class:`~envloop.experience.rollout_options.RolloutSettings`)."""
        return cls(
            task_to_env, options.env_step_timeout_s, options.on_env_error,
            options.env_max_retries, options.env_startup_timeout_s,
        )  # fmt: skip

    def step(
        self, groups: dict[str, list[int]], env_logs: list[list[dict]], metadata: list[Any]
    ) -> list[GroupResult]:
        """Step each group's environment on its samples' logs and metadata, concurrently
        (first waiting for new actors to start, unless :meth:`wait_until_started` did). The
        groups of an environment that did not start in time fail at once."""
        self.wait_until_started(groups)
        started = {t: idx for t, idx in groups.items() if t not in self._not_started}
        pending = {
            task: self._submit(task, [env_logs[i] for i in idx], [metadata[i] for i in idx])
            for task, idx in started.items()
        }
        deadline = self._deadline()
        results = []
        for task, idx in groups.items():
            result = GroupResult(task, idx)
            try:
                if task in self._not_started:
                    raise _NotStarted(self._not_started[task])
                ret = self._collect(task, pending[task], deadline, env_logs, metadata, idx)
                result.result = _validated(task, ret, len(idx))
            except Exception as exc:
                result.error = self._failure(task, exc)
            results += self._split_sample_errors(result)
        return results

    def streams(self, task: str) -> bool:
        """Whether ``task``'s environment hands back each sample as it finishes
        (``step_stream``, as every :class:`SampleEnvironment` does, in process or as an
        actor)."""
        return hasattr(self.task_to_env[task], "step_stream")

    def step_stream(
        self,
        task: str,
        samples: list[int],
        env_logs: list[list[dict]],
        metadata: list[Any],
        deliver: Callable[[GroupResult], None],
    ) -> None:
        """Step ``task``'s environment on ``samples`` (one call, see :meth:`streams`) and
        ``deliver`` each sample's result the moment it comes: the timeout, retries after
        an actor restart, contract checks and error policy of :meth:`step`, per sample (a
        timeout or a step that raised fails the samples not delivered yet)."""
        self.wait_until_started({task: samples})
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        left = list(range(len(samples)))
        for attempt in range(self.max_retries + 1):
            rows = list(left)  # this attempt's call steps these, in this order
            try:
                for positions, value in self._stream(
                    task, rows, samples, env_logs, metadata, deadline
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
            except Exception as exc:
                if attempt < self.max_retries and isinstance(exc, RayActorError):
                    self._await_restart(task)
                    continue
                deliver(
                    GroupResult(task, [samples[r] for r in left], error=self._failure(task, exc))
                )
                return

    def _stream(
        self,
        task: str,
        rows: list[int],
        samples: list[int],
        env_logs: list[list[dict]],
        metadata: list[Any],
        deadline: float | None,
    ) -> Iterator[tuple[list[int], Any]]:
        """``(positions in rows, their return)`` from one ``step_stream`` call, as they come;
        raises TimeoutError at ``deadline``."""
        env = self.task_to_env[task]
        logs = [env_logs[samples[r]] for r in rows]
        mds = [metadata[samples[r]] for r in rows]
        if is_actor(env):
            sent_at = time.monotonic()
            stream = env.astep_stream.options(num_returns="streaming").remote(logs, mds)
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait([stream], timeout=remaining)
                if not ready:
                    self._retire(task, stream, sent_at)
                    raise _ActorTimeout
                try:
                    ref = next(stream)
                except StopIteration:
                    return
                yield ray.get(ref)
        items: queue.Queue[tuple[list[int], Any] | BaseException | None] = queue.Queue()
        stream = env.step_stream(copy.deepcopy(logs), copy.deepcopy(mds))
        # A daemon thread: one stuck on a sample that overran the timeout must not keep
        # the interpreter from exiting (a pool's threads are joined at exit).
        threading.Thread(target=_drain_into, args=(stream, items), daemon=True).start()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = items.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

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

    def _submit(self, task: str, logs: list[list[dict]], metadata: list[Any]) -> _Call:
        env = self.task_to_env[task]
        if is_actor(env):
            return _Call(env.step.remote(logs, metadata), time.monotonic())
        # Copies, so an in-process environment sees what an actor would: its own objects.
        if self._pool is None:
            # One thread per step in flight (their callers bound how many): a step abandoned
            # at its timeout must not hold a slot that later steps wait for.
            self._pool = DaemonThreadPool(None, "envloop-env")
        step = self._pool.submit(env.step, copy.deepcopy(logs), copy.deepcopy(metadata))
        return _Call(step, time.monotonic())

    def _deadline(self) -> float | None:
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def _retire(self, task: str, call: Any, sent_at: float) -> None:
        """``task``'s actor overran a step: cancel the call and restart the actor, so that no
        later call queues behind the hung step; wait for the new actor before the next step."""
        env = self.task_to_env[task]
        retire_stuck_actor(env, call, sent_at)
        self._gate.forget(env)

    def _await_restart(self, task: str) -> None:
        """``task``'s actor died: wait (bounded) for Ray to restart it before a retry (an
        in-process environment that lost an actor of its own retries at once)."""
        if is_actor(self.task_to_env[task]):
            self._gate.forget(self.task_to_env[task])
            self.wait_until_started({task: []})

    def _collect(
        self,
        task: str,
        call: _Call,
        deadline: float | None,
        env_logs: list[list[dict]],
        metadata: list[Any],
        idx: list[int],
    ) -> Any:
        """The result of ``call``, a step of ``task``'s environment, by ``deadline``; a step
        whose actor died is retried (``max_retries``) once Ray has restarted the actor, with
        a deadline of its own."""
        for attempt in range(self.max_retries + 1):
            try:
                return self._wait(task, call, deadline)
            except Exception as exc:
                if attempt == self.max_retries or not isinstance(exc, RayActorError):
                    raise
                self._await_restart(task)
                if task in self._not_started:
                    raise _NotStarted(self._not_started[task]) from exc
                call = self._submit(task, [env_logs[i] for i in idx], [metadata[i] for i in idx])
                deadline = self._deadline()
        raise AssertionError("unreachable")

    def _wait(self, task: str, call: _Call, deadline: float | None) -> Any:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if isinstance(call.handle, Future):
            return call.handle.result(timeout=remaining)
        try:
            return ray.get(call.handle, timeout=remaining)
        except GetTimeoutError:
            self._retire(task, call.handle, call.sent_at)
            raise _ActorTimeout from None

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
        if isinstance(exc, _ActorTimeout):
            text = (
                f"env {task}.step timed out after {self.timeout_s} s; its actor was killed for "
                "Ray to restart (Ray cannot stop a running step, and later steps would queue "
                "behind it)"
            )
        elif isinstance(exc, (TimeoutError, FutureTimeout, GetTimeoutError)):
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


class _ActorTimeout(TimeoutError):
    """An actor's step timed out, and the actor was killed for Ray to restart."""


@dataclass
class _Call:
    """A step in flight: a Ray ``ObjectRef`` or an in-process ``Future``, and when it was sent."""

    handle: Any
    sent_at: float


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


def _drain_into(
    stream: Iterator[tuple[list[int], Any]],
    items: queue.Queue[tuple[list[int], Any] | BaseException | None],
) -> None:
    """Put each item of ``stream`` into ``items``, then None (or the exception it raised)."""
    try:
        for item in stream:
            items.put(item)
        items.put(None)
    except BaseException as exc:
        items.put(exc)


def _format_exception(exc: BaseException) -> str:
    if isinstance(exc, RayTaskError):
        return str(exc)  # already holds the remote traceback
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
