"""Per-sample environments: write how ONE sample steps; the batched ``step`` comes with it.

A :class:`SampleEnvironment` implements ``step_sample(messages, metadata) -> SampleStep`` (or
``async def astep_sample(...)`` for I/O-bound work: HTTP calls, sandboxes, judges) and
inherits the batched :meth:`~SampleEnvironment.step` of the environment contract, with its
tensors, and a ``global_post_process_and_metrics`` that reports no metrics:

>>> class Shout(SampleEnvironment):
...     def step_sample(self, messages, metadata):
...         text = messages[-1]["content"]
...         return SampleStep(text.upper(), reward=float(text.isupper()), terminated=True)
>>> ret = Shout().step([[{"role": "assistant", "content": "hi"}]], [None])
>>> ret.observations, ret.rewards, ret.terminateds
([{'role': 'environment', 'content': 'HI'}], tensor([0.]), tensor([True]))

**How samples run.** With ``astep_sample``, every sample of the batch runs concurrently on
an event loop that the environment keeps in a thread of its own (so ``step`` works from any
thread, a Ray actor's included, and async clients made in one step serve the next), at most
``max_concurrent_samples`` at a time when that is set. With ``step_sample`` only, samples run
one after another in the caller's thread, or over a pool of ``max_concurrent_samples``
threads when that is above 1. Results are in input order either way.

**Failures are data.** An exception in one sample's method (or a result that is not a valid
:class:`SampleStep`) fails that sample only: it comes back terminated, with reward 0 (0 for
every component), an empty observation, its metadata unchanged, and the error text, e.g.
``"Calc.step_sample raised KeyError: 'target'"`` and the traceback, in
``EnvironmentReturn.errors``; the rollout engine records that text on that sample alone
(``env_error``; ``loss_multiplier`` 0), and the other samples go on. When every sample of a
batch fails there is nothing to return: ``step`` raises the first sample's exception (the
engine then records it on each of them, as for any ``step`` that raises).
"""

from __future__ import annotations

import asyncio
import numbers
import threading
import traceback
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from envloop.data.content_parts import is_message_content
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.daemon_threads import DaemonThreadPool
from envloop.distributed.loop_thread import LoopThread
from envloop.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    MetadataT,
    RewardsType,
)

__all__ = ["SampleEnvironment", "SampleStep"]


_MISSING = (
    "{name} implements neither step_sample nor astep_sample; a SampleEnvironment "
    "implements one of them."
)


@dataclass(frozen=True)
class SampleStep:
    """What one sample's step returns; checked when made (a bad value raises, failing only
    that sample).

    Attributes:
        observation: the environment's reply, a ``{"role", "content"}`` dict or a plain
            string (sent with the environment's ``observation_role``).
        reward: this turn's reward; leave it None when giving ``reward_components``.
        terminated: True when the episode ended.
        reward_components: several rewards instead of one, ``{name: value}``; in the batch
            they become ``rewards["reward/<name>"]`` (a name already starting with
            ``reward/`` is kept as is), summed into the sample's total reward by the engine.
        metadata: the sample's metadata for the next turn; None keeps the one it came with.
        next_stop_strings: stop strings of the sample's next generation; None: EOS only.
        answer: the answer the environment read from the response, if any.
    """

    observation: str | Mapping[str, str]
    reward: float | None = None
    terminated: bool = False
    reward_components: Mapping[str, float] | None = None
    metadata: Any = None
    next_stop_strings: list[str] | None = None
    answer: str | None = None

    def __post_init__(self) -> None:
        problems = _step_problems(self)
        if problems:
            raise ValueError("invalid SampleStep: " + "; ".join(problems))

    def component_rewards(self) -> dict[str, float]:
        """This sample's rewards keyed as in a batch: ``{"reward/<name>": value}``, or
        ``{"reward/scalar": reward}`` for a single reward (``calculate_rewards``' name).

        >>> SampleStep("ok", reward_components={"format": 1}).component_rewards()
        {'reward/format': 1.0}
        """
        if self.reward_components is None:
            return {"reward/scalar": float(self.reward or 0.0)}
        return {
            (k if k.startswith("reward/") else f"reward/{k}"): float(v)
            for k, v in self.reward_components.items()
        }


class _Failure(NamedTuple):
    """A sample whose method raised: the exception, and its text with the boundary."""

    error: Exception
    text: str


_Outcome = SampleStep | _Failure


class SampleEnvironment(EnvironmentInterface[MetadataT]):
    """An environment written one sample at a time; see the module docstring.

    Implement :meth:`step_sample`, or ``async def astep_sample(self, messages, metadata)
    -> SampleStep`` (used by ``step`` whenever the class defines it). Optionally override
    ``global_post_process_and_metrics`` (default: the batch unchanged and no metrics) and
    ``shutdown`` (call ``super().shutdown()``: it stops the event loop of ``astep_sample``).

    Class attributes (an instance may set its own, e.g. from its config):
        observation_role: the role of observations returned as plain strings.
        max_concurrent_samples: at most this many samples of a batch at once; None runs
            ``step_sample`` one sample at a time and ``astep_sample`` for all at once.
            Above 1, ``step_sample`` runs in several threads at once: keep it thread-safe.
    """

    observation_role: str = "environment"
    max_concurrent_samples: int | None = None

    if TYPE_CHECKING:  # declared for type checkers only: Ray makes a class with any
        # ``async def`` an asyncio actor, which a sync-only environment must not become.

        async def astep_sample(
            self, messages: LLMMessageLogType, metadata: MetadataT
        ) -> SampleStep: ...

    def step_sample(self, messages: LLMMessageLogType, metadata: MetadataT) -> SampleStep:
        """Step one sample: ``messages`` is its conversation (``role`` and ``content``; the
        last message is the policy's response), ``metadata`` its metadata."""
        raise NotImplementedError(_MISSING.format(name=type(self).__name__))

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Step every sample (extra arguments are accepted and ignored). Rewards [B] float32,
        or ``{"reward/<name>": [B] float32}`` when any sample gives ``reward_components``
        (a sample with a single reward then counts it as ``reward/scalar``); terminateds [B]
        bool; answers one per sample; errors as the module docstring says."""
        if len(message_log_batch) != len(metadata):
            raise ValueError(
                f"{type(self).__name__}.step: {len(message_log_batch)} message logs but "
                f"{len(metadata)} metadata entries; give one of each per sample."
            )
        outcomes = self._outcomes(list(message_log_batch), list(metadata))
        return _batched_return(outcomes, list(metadata), self.observation_role)

    def step_stream(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[Any]
    ) -> Iterator[tuple[list[int], EnvironmentReturn]]:
        """Step every sample as :meth:`step` does, yielding ``(rows, their return)`` as
        samples finish, those that finished together in one item (the async engine hands
        them on at once). A sample that failed comes with its error text in ``errors``,
        never as an exception."""
        logs, metadata = list(message_log_batch), list(metadata)
        for finished in self._outcomes_as_finished(logs, metadata):
            yield self._stream_item(finished, metadata)

    async def astep_stream(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[Any]
    ) -> AsyncIterator[tuple[list[int], EnvironmentReturn]]:
        """:meth:`step_stream` for an event loop (a Ray actor's: the async engine calls this
        one there), so that calls overlap. ``astep_sample`` samples run on the environment's
        own loop, as in ``step``; ``step_sample`` samples run on threads of the
        environment's, at most ``max_concurrent_samples`` (None: 1) at once over all
        calls."""
        logs, metadata = list(message_log_batch), list(metadata)
        limit = _checked_limit(self)
        pending: dict[asyncio.Future[_Outcome], int]
        if getattr(type(self), "astep_sample", None) is not None:
            slots = asyncio.Semaphore(limit) if limit is not None else None
            runner = _loop_of(self)
            pending = {
                asyncio.wrap_future(runner.submit(self._async_outcome(log, md, slots))): row
                for row, (log, md) in enumerate(zip(logs, metadata))
            }
        elif type(self).step_sample is SampleEnvironment.step_sample:
            raise NotImplementedError(_MISSING.format(name=type(self).__name__))
        else:
            loop, threads = asyncio.get_running_loop(), _threads_of(self, limit or 1)
            pending = {
                loop.run_in_executor(threads, self._sample_outcome, log, md): row
                for row, (log, md) in enumerate(zip(logs, metadata))
            }
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished = sorted((pending.pop(f), f.result()) for f in done)
            yield self._stream_item(finished, metadata)

    def _stream_item(
        self, finished: list[tuple[int, _Outcome]], metadata: list[Any]
    ) -> tuple[list[int], EnvironmentReturn]:
        rows = [row for row, _ in finished]
        outcomes = [outcome for _, outcome in finished]
        ret = _batched_return(outcomes, [metadata[r] for r in rows], self.observation_role, True)
        return rows, ret

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """The batch unchanged, and no metrics."""
        return batch, {}

    def shutdown(self) -> None:
        """Stop the event loop thread of ``astep_sample``, if one was started."""
        runner = self.__dict__.pop("_sample_loop", None)
        if runner is not None:
            runner.close(wait=True)
        threads = self.__dict__.pop("_sample_threads", None)
        if threads is not None:
            threads.shutdown(wait=False, cancel_futures=True)

    def _outcomes(self, logs: list[LLMMessageLogType], metadata: list[Any]) -> list[_Outcome]:
        """Every sample's outcome, in input order (see :meth:`_outcomes_as_finished`)."""
        outcomes: list[_Outcome | None] = [None] * len(logs)
        for finished in self._outcomes_as_finished(logs, metadata):
            for row, outcome in finished:
                outcomes[row] = outcome
        return cast(list[_Outcome], outcomes)

    def _outcomes_as_finished(
        self, logs: list[LLMMessageLogType], metadata: list[Any]
    ) -> Iterator[list[tuple[int, _Outcome]]]:
        """``(row, outcome)`` of the samples that finished together, in the order they
        finish: ``astep_sample`` samples all at once on the environment's loop (at most
        ``max_concurrent_samples`` in flight), ``step_sample`` samples one after another in
        this thread, or over a pool of ``max_concurrent_samples`` threads when above 1."""
        limit = _checked_limit(self)
        if getattr(type(self), "astep_sample", None) is not None:
            slots = asyncio.Semaphore(limit) if limit is not None else None
            runner = _loop_of(self)
            futures = {
                runner.submit(self._async_outcome(log, md, slots)): row
                for row, (log, md) in enumerate(zip(logs, metadata))
            }
        elif type(self).step_sample is SampleEnvironment.step_sample:
            raise NotImplementedError(_MISSING.format(name=type(self).__name__))
        elif limit is None or limit == 1 or len(logs) < 2:
            for row, (log, md) in enumerate(zip(logs, metadata)):
                yield [(row, self._sample_outcome(log, md))]
            return
        else:
            # Daemon threads: a sample stuck past the rollout's timeout must not keep the
            # interpreter from exiting.
            pool = DaemonThreadPool(min(limit, len(logs)), "envloop-sample")
            futures = {
                pool.submit(self._sample_outcome, log, md): row
                for row, (log, md) in enumerate(zip(logs, metadata))
            }
            pool.shutdown(wait=False)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield sorted((futures[f], f.result()) for f in done)

    def _sample_outcome(self, messages: LLMMessageLogType, metadata: Any) -> _Outcome:
        try:
            return _checked_step(self, "step_sample", self.step_sample(messages, metadata))
        except Exception as exc:
            return _failure(self, "step_sample", exc)

    async def _async_outcome(
        self, messages: LLMMessageLogType, metadata: Any, slots: asyncio.Semaphore | None
    ) -> _Outcome:
        try:
            if slots is None:
                step = await self.astep_sample(messages, metadata)
            else:
                async with slots:
                    step = await self.astep_sample(messages, metadata)
            return _checked_step(self, "astep_sample", step)
        except Exception as exc:
            return _failure(self, "astep_sample", exc)


def _batched_return(
    outcomes: Sequence[SampleStep | _Failure],
    metadata: list[Any],
    observation_role: str,
    keep_failures: bool = False,
) -> EnvironmentReturn:
    """One ``EnvironmentReturn`` from B per-sample outcomes (``metadata``: the B inputs).

    Raises the first sample's exception when every sample failed, unless ``keep_failures``."""
    failures = [o for o in outcomes if isinstance(o, _Failure)]
    if failures and len(failures) == len(outcomes) and not keep_failures:
        raise failures[0].error
    steps = [o if isinstance(o, SampleStep) else None for o in outcomes]
    errors = [o.text if isinstance(o, _Failure) else None for o in outcomes]
    return EnvironmentReturn(
        observations=[_observation(s, observation_role) for s in steps],
        metadata=[
            md if s is None or s.metadata is None else s.metadata for s, md in zip(steps, metadata)
        ],
        next_stop_strings=[None if s is None else s.next_stop_strings for s in steps],
        rewards=_rewards(steps),
        terminateds=torch.tensor([s is None or s.terminated for s in steps], dtype=torch.bool),
        answers=[None if s is None else s.answer for s in steps],
        errors=errors if failures else None,
    )


def _observation(step: SampleStep | None, role: str) -> dict[str, str]:
    if step is None:
        return {"role": role, "content": ""}
    if isinstance(step.observation, str):
        return {"role": role, "content": step.observation}
    return dict(step.observation)


def _rewards(steps: list[SampleStep | None]) -> RewardsType:
    """[B] float32 rewards, or a dict of [B] float32 components (0 where a sample lacks one)."""
    if all(s is None or s.reward_components is None for s in steps):
        rewards = [0.0 if s is None else float(s.reward or 0.0) for s in steps]
        return torch.tensor(rewards, dtype=torch.float32)
    per_sample = [{} if s is None else s.component_rewards() for s in steps]
    names = dict.fromkeys(name for rewards in per_sample for name in rewards)
    return {
        name: torch.tensor([r.get(name, 0.0) for r in per_sample], dtype=torch.float32)
        for name in names
    }


def _step_problems(step: SampleStep) -> list[str]:
    problems = []
    obs = step.observation
    if not isinstance(obs, str) and not (
        isinstance(obs, Mapping)
        and isinstance(obs.get("role"), str)
        and is_message_content(obs.get("content"))
    ):
        expected = "a str or {'role': str, 'content': str or a list of text/image parts}"
        problems.append(f"observation must be {expected}, got {obs!r:.80}")
    if (step.reward is None) == (step.reward_components is None):
        problems.append("give exactly one of reward and reward_components")
    elif step.reward is not None and not _is_real(step.reward):
        problems.append(f"reward must be a number, got {step.reward!r:.80}")
    elif step.reward_components is not None:
        problems += _component_problems(step.reward_components)
    if not isinstance(step.terminated, bool):
        problems.append(
            f"terminated must be a bool, got {type(step.terminated).__name__} "
            f"({step.terminated!r:.40}); use bool(...)"
        )
    stops = step.next_stop_strings
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    ):
        expected = "None or a list of non-empty str"
        problems.append(f"next_stop_strings must be {expected}, got {stops!r:.80}")
    if step.answer is not None and not isinstance(step.answer, str):
        problems.append(f"answer must be a str or None, got {type(step.answer).__name__}")
    return problems


def _component_problems(components: Any) -> list[str]:
    if not isinstance(components, Mapping) or not components:
        expected = "a non-empty {name: number} dict"
        return [f"reward_components must be {expected}, got {components!r:.80}"]
    bad = [k for k, v in components.items() if not (isinstance(k, str) and k) or not _is_real(v)]
    return [f"reward_components[{k!r}]: expected a str name and a number" for k in bad]


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real)


def _checked_step(env: Any, method: str, step: Any) -> SampleStep:
    if not isinstance(step, SampleStep):
        raise TypeError(
            f"{type(env).__name__}.{method} returned a {type(step).__name__}; it must return "
            "a SampleStep."
        )
    return step


def _failure(env: Any, method: str, exc: Exception) -> _Failure:
    summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    return _Failure(exc, f"{type(env).__name__}.{method} raised {summary}\n{trace}")


def _checked_limit(env: Any) -> int | None:
    limit = env.max_concurrent_samples
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(
            f"{type(env).__name__}.max_concurrent_samples must be None or an int >= 1, "
            f"got {limit!r}."
        )
    return limit


_LOOP_LOCK = threading.Lock()
_REENTRY = "step() was called from inside astep_sample(); await instead."


def _threads_of(env: SampleEnvironment[Any], limit: int) -> DaemonThreadPool:
    """``env``'s threads for ``step_sample`` calls of :meth:`SampleEnvironment.astep_stream`,
    started on first use (``limit`` of them)."""
    with _LOOP_LOCK:
        threads = env.__dict__.get("_sample_threads")
        if threads is None:
            threads = env.__dict__["_sample_threads"] = DaemonThreadPool(limit, "envloop-sample")
        return threads


def _loop_of(env: SampleEnvironment[Any]) -> LoopThread:
    """``env``'s event loop thread, started on first use and stopped when ``env`` is
    garbage-collected (or on ``shutdown``)."""
    with _LOOP_LOCK:
        runner = env.__dict__.get("_sample_loop")
        if runner is None:
            runner = env.__dict__["_sample_loop"] = LoopThread("envloop-sample-loop", _REENTRY)
            weakref.finalize(env, runner.close)
        return runner
