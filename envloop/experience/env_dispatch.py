"""Step every task group's environment concurrently; failures become per-sample data.

One call per environment per turn: samples are grouped by ``task_name``, every group's
``step`` is started at once (a Ray actor call, or a thread for an in-process environment),
and the results are collected against one deadline. A step that raises or times out fails
its whole group; a step that returns ``errors`` (e.g. a
:class:`~envloop.environments.sample_environment.SampleEnvironment` whose method raised on
one sample) fails only those samples: each becomes a one-sample group with its error.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from envloop.distributed.ray_utils import is_actor
from envloop.environments.contract import coerce_env_return, env_return_problems
from envloop.environments.interfaces import EnvironmentReturn
from envloop.environments.registry import unknown_name_message


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
        max_threads: int | None = None,
    ) -> None:
        self.task_to_env = task_to_env
        self.max_threads = max_threads
        # An infinite limit is no limit (Ray's and the clock's waits take finite seconds).
        self.timeout_s = timeout_s if timeout_s is not None and math.isfinite(timeout_s) else None
        self.on_error = on_error
        self.max_retries = max_retries
        self._pool: ThreadPoolExecutor | None = None
        self._started: set[str] = set()

    @classmethod
    def from_options(
        cls, task_to_env: dict[str, Any], options: Any, max_threads: int | None = None
    ) -> EnvDispatcher:
        """A dispatcher with the timeout, error policy and retries of rollout ``options``
        (:class:`~envloop.experience.rollout_options.RolloutSettings`); ``max_threads``:
        in-process steps that may run at once (None: Python's default pool size)."""
        return cls(
            task_to_env, options.env_step_timeout_s, options.on_env_error,
            options.env_max_retries, max_threads,
        )  # fmt: skip

    def step(
        self, groups: dict[str, list[int]], env_logs: list[list[dict]], metadata: list[Any]
    ) -> list[GroupResult]:
        """Step each group's environment on its samples' logs and metadata, concurrently
        (first waiting for new actors to start, unless :meth:`wait_until_started` did)."""
        self.wait_until_started(groups)
        pending = {
            task: self._submit(task, [env_logs[i] for i in idx], [metadata[i] for i in idx])
            for task, idx in groups.items()
        }
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        results = []
        for task, idx in groups.items():
            result = GroupResult(task, idx)
            try:
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
            stream = env.astep_stream.options(num_returns="streaming").remote(logs, mds)
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait([stream], timeout=remaining)
                if not ready:
                    ray.cancel(stream)
                    raise TimeoutError
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
        """Stop the thread pool without waiting for steps that overran their timeout."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def wait_until_started(self, groups: dict[str, list[int]]) -> None:
        """Wait for the constructors of the groups' actors not seen before, so start-up never
        counts against the step timeout (nor in the step's timing).

        A constructor that raised surfaces on the group's first step, as that step's error.
        """
        new = [t for t in groups if t not in self._started and is_actor(self.task_to_env[t])]
        if new:
            refs = [self.task_to_env[t].__ray_ready__.remote() for t in new]
            ray.wait(refs, num_returns=len(refs))
        self._started.update(groups)

    def _submit(self, task: str, logs: list[list[dict]], metadata: list[Any]) -> Any:
        env = self.task_to_env[task]
        if is_actor(env):
            return env.step.remote(logs, metadata)
        # Copies, so an in-process environment sees what an actor would: its own objects.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_threads, thread_name_prefix="envloop-env")
        return self._pool.submit(env.step, copy.deepcopy(logs), copy.deepcopy(metadata))

    def _collect(
        self,
        task: str,
        handle: Any,
        deadline: float | None,
        env_logs: list[list[dict]],
        metadata: list[Any],
        idx: list[int],
    ) -> Any:
        for attempt in range(self.max_retries + 1):
            try:
                return _wait(handle, deadline)
            except Exception as exc:
                if attempt == self.max_retries or not isinstance(exc, RayActorError):
                    raise
                handle = self._submit(task, [env_logs[i] for i in idx], [metadata[i] for i in idx])
        raise AssertionError("unreachable")

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
        if isinstance(exc, (TimeoutError, FutureTimeout, GetTimeoutError)):
            text = f"env {task}.step timed out after {self.timeout_s} s"
        elif isinstance(exc, _ContractError):
            text = str(exc)
        else:
            text = f"env {task}.step raised:\n{_format_exception(exc)}"
        if self.on_error == "raise":
            raise EnvironmentStepError(text) from exc
        return text


class _ContractError(ValueError):
    pass


def _validated(task: str, value: Any, n: int) -> EnvironmentReturn:
    try:
        ret = coerce_env_return(value)
    except TypeError as exc:
        raise _ContractError(f"env {task}.step: {exc}") from exc
    problems = env_return_problems(ret, n)
    if problems:
        raise _ContractError(
            f"env {task}.step broke the EnvironmentReturn contract: " + "; ".join(problems)
        )
    return ret


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


def _wait(handle: Any, deadline: float | None) -> Any:
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    if isinstance(handle, Future):
        return handle.result(timeout=remaining)
    try:
        return ray.get(handle, timeout=remaining)
    except GetTimeoutError:
        ray.cancel(handle)
        raise


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
