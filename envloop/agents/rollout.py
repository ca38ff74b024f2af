"""``run_agent_rollouts``: agent programs written against the OpenAI API as rollouts.

Every sample's agent runs as ``await agent(base_url, datum)`` against its own session of an
:class:`~envloop.agents.endpoint.AgentEndpoint`, concurrently (at most
``max_concurrent_agents`` at once). When an agent returns, its recorded conversation is
scored by the sample's environment exactly as the rollout engines score a turn: one
``step`` with the conversation's role/content log and the sample's metadata, whose reward,
observation (tokenized and appended) and metadata are recorded
(:func:`~envloop.experience.rollout_state.take_env_results`). The result is the engines'
final batch and metrics, so GRPO blocks and trainer integrations consume it unchanged.

Rows: one per trajectory segment. A session whose history was never rewritten is one row;
each rewrite starts a segment, and each segment is a row of the same sample (in order,
``agent_sample_index`` naming the input row) carrying the sample's reward, so every token
the policy sampled is trained on exactly once, in the context it was sampled in.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from envloop.agents.endpoint import AgentEndpoint
from envloop.agents.sessions import Session
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.env_dispatch import EnvDispatcher, check_tasks_have_envs, group_by_task
from envloop.experience.rollout_call import RolloutCall
from envloop.experience.rollout_metrics import PhaseTimer, rollout_metrics, rollout_progress
from envloop.experience.rollout_options import RolloutOptions
from envloop.experience.rollout_results import slot_rows
from envloop.experience.rollout_state import (
    RolloutState,
    check_limits,
    observation_renderer,
    take_env_results,
)
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["Agent", "run_agent_rollouts"]

Agent = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""``async def agent(base_url, datum) -> float | None``."""


@dataclass
class _Outcome:
    """One sample's agent run: its session, the reward it returned, its failure text."""

    session: Session
    reward: float | None = None
    error: str | None = None
    timed_out: bool = False


def run_agent_rollouts(
    agent: Agent,
    input_batch: BatchedDataDict[Any],
    policy_generation: GenerationInterface,
    tokenizer: Any,
    task_to_env: dict[str, Any],
    *,
    max_seq_len: int,
    max_concurrent_agents: int = 64,
    agent_timeout_s: float | None = 600.0,
    tool_call_format: str | None = None,
    endpoint: AgentEndpoint | None = None,
    **options: Any,
) -> RolloutCall:
    """Run ``agent`` once per sample of ``input_batch`` and score what it did.

    Args:
        agent: ``async def agent(base_url, datum)``: ``base_url`` is the sample's own
            session (``http://127.0.0.1:<port>/s/<session>/v1``, for
            ``openai.AsyncOpenAI(base_url=...)``), ``datum`` the sample's row as a dict
            (``message_log``, ``extra_env_info``, ``task_name``, ...). It may return a float
            reward, added to the environment's, or None.
        input_batch: ``DatumSpec`` columns, as for the rollout engines (B rows).
        policy_generation: the policy the endpoint serves.
        tokenizer: the policy's tokenizer (its chat template renders the agents' requests).
        task_to_env: task name -> environment, as for the engines.
        max_seq_len: no segment grows past this many tokens (a response is cut to fit; a
            request with no room left is refused with ``context_length_exceeded``).
        max_concurrent_agents: agents running at once.
        agent_timeout_s: seconds an agent may run (None: no limit); one that takes longer
            is cancelled and fails its sample.
        tool_call_format: ``hermes`` or ``llama3``; None: from the chat template.
        endpoint: serve through this started endpoint (None: one of its own, stopped at
            the end).
        **options: those of ``run_multi_turn_rollout`` (``observation_format``,
            ``env_step_timeout_s``, ``on_env_error``, ``env_max_retries``,
            ``env_startup_timeout_s``, ``on_turn``: called once, when the batch is scored).

    Returns:
        ``(final_batch, metrics)`` (``await`` it, or unpack it from synchronous code). The
        final batch has B' >= B rows, one per segment (see the module docstring), with the
        engines' columns (``message_log``, ``total_reward`` [B'] float32, ``truncated``,
        ``terminated``, ``num_turns`` (responses sampled in the segment),
        ``turn_rewards``, ``env_error``, ``loss_multiplier``, ...) and
        ``agent_sample_index`` [B'] int64 (the input row), ``agent_segment`` [B'] int64,
        ``agent_segment_reason`` (``"start"`` or ``"rewrite: ..."``), ``agent_reward``
        [B'] float32 (what the agent returned; 0 for None). An agent that raised, timed out
        or returned something other than a float or None fails its sample: its rows keep
        what was recorded, with ``loss_multiplier`` 0 and the failure in ``env_error``
        (counted in ``env_error_rate``), and its environment is not stepped. A sample whose
        agent made no request keeps its input ``message_log``.
        Metrics: the engines' (over the B' rows) and ``agent_error_rate``,
        ``agent_timeout_rate``, ``segments_per_sample``, ``rewrite_rate`` (over the B
        samples) and ``timing/agents_s``.
    """
    opts = RolloutOptions.from_mapping(options)
    check_limits(max_seq_len, 1)
    if not isinstance(max_concurrent_agents, int) or max_concurrent_agents < 1:
        raise ValueError(
            f"max_concurrent_agents must be an int >= 1, got {max_concurrent_agents!r}"
        )
    if agent_timeout_s is not None and not agent_timeout_s > 0:
        raise ValueError(f"agent_timeout_s must be > 0 or None, got {agent_timeout_s!r}")
    if endpoint is not None and (
        endpoint.service.max_seq_len is None or endpoint.service.max_seq_len > max_seq_len
    ):
        raise ValueError(
            f"The endpoint given serves conversations up to max_seq_len="
            f"{endpoint.service.max_seq_len}, more than this rollout's max_seq_len={max_seq_len}; "
            f"build it with AgentEndpoint(..., max_seq_len={max_seq_len}) or leave endpoint out."
        )
    task_names = list(input_batch.get("task_name") or [])
    check_tasks_have_envs(task_names, task_to_env)
    run = _AgentRun(
        agent, input_batch, policy_generation, tokenizer, task_to_env, max_seq_len,
        max_concurrent_agents, agent_timeout_s, tool_call_format, endpoint, opts,
    )  # fmt: skip
    return RolloutCall(run.run())


class _AgentRun:
    def __init__(
        self,
        agent: Agent,
        batch: BatchedDataDict[Any],
        policy: GenerationInterface,
        tokenizer: Any,
        task_to_env: dict[str, Any],
        max_seq_len: int,
        max_concurrent: int,
        timeout_s: float | None,
        tool_call_format: str | None,
        endpoint: AgentEndpoint | None,
        opts: RolloutOptions,
    ) -> None:
        self.agent, self.batch, self.tokenizer = agent, batch, tokenizer
        self.task_to_env, self.max_seq_len, self.opts = task_to_env, max_seq_len, opts
        self.max_concurrent, self.timeout_s = max_concurrent, timeout_s
        self.own_endpoint = endpoint is None
        self.endpoint = endpoint or AgentEndpoint(
            policy, tokenizer, max_seq_len=max_seq_len, tool_call_format=tool_call_format
        )
        self.timer = PhaseTimer()

    async def run(self) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        if self.own_endpoint:
            await asyncio.to_thread(self.endpoint.start)
        self.endpoint.service.timer = self.timer
        try:
            outcomes = await self._run_agents()
        finally:
            if self.own_endpoint:
                await asyncio.to_thread(self.endpoint.stop)
        rows = _rows(outcomes)
        state = self._state(outcomes, rows)
        await self._score(state, outcomes, rows)
        final = self._final_batch(state, outcomes, rows)
        metrics = {**rollout_metrics(state, torch.zeros(state.size, dtype=torch.bool), self.timer)}
        metrics.update(_agent_metrics(outcomes, self.timer))
        if self.opts.on_turn is not None:
            self.opts.on_turn(rollout_progress(state, self.timer))
        return final, metrics

    async def _run_agents(self) -> list[_Outcome]:
        rollout = uuid.uuid4().hex[:12]
        sessions = [self.endpoint.open_session(f"{rollout}-{i}") for i in range(_size(self.batch))]
        limit = asyncio.Semaphore(self.max_concurrent)

        async def one(i: int, session: Session) -> _Outcome:
            async with limit:
                return await self._run_agent(session, _datum(self.batch, i))

        with self.timer.phase("agents"):
            try:
                return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions))))
            finally:
                for session in sessions:
                    self.endpoint.close_session(session.id)

    async def _run_agent(self, session: Session, datum: dict[str, Any]) -> _Outcome:
        outcome = _Outcome(session)
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(self.agent(session.base_url, datum), self.timeout_s)
        except TimeoutError as error:
            if self.timeout_s is None or time.monotonic() - started < self.timeout_s:
                outcome.error = f"agent raised {type(error).__name__}: {error}"  # its own
            else:
                outcome.error = f"agent did not finish within agent_timeout_s={self.timeout_s} s"
                outcome.timed_out = True
        except Exception as error:
            outcome.error = f"agent raised {type(error).__name__}: {error}"
        else:
            outcome.reward, outcome.error = _reward(result)
        if outcome.error is not None and session.request_errors:
            outcome.error += f" (last request the endpoint refused: {session.request_errors[-1]})"
        return outcome

    def _state(self, outcomes: list[_Outcome], rows: list[tuple[int, int]]) -> RolloutState:
        logs = [
            outcomes[i].session.segments[j].message_log if j >= 0 else self.batch["message_log"][i]
            for i, j in rows
        ]
        row_batch = self.batch.select_indices([i for i, _ in rows])
        row_batch["message_log"] = logs
        state = RolloutState.empty(len(rows), self.tokenizer, self.max_seq_len)
        state.load(list(range(len(rows))), row_batch)
        for r, (i, j) in enumerate(rows):
            if j >= 0:
                segment = outcomes[i].session.segments[j]
                state.turns[r] = segment.sampled_turns
                state.gen_tokens[r] = segment.sampled_tokens
                state.env_tokens[r] = (
                    len(segment.token_ids) - segment.prompt_tokens - segment.sampled_tokens
                )
                versions = [
                    m["generation_policy_versions"] for m in segment.message_log
                    if "generation_policy_versions" in m and len(m["generation_policy_versions"])
                ]  # fmt: skip
                if versions:
                    every = torch.cat(versions)
                    state.min_version[r], state.max_version[r] = every.min(), every.max()
                state.env_views[r] = [_env_message(m) for m in segment.history]
            if outcomes[i].error is not None:
                state.failed[r] = True
                state.errors[r] = outcomes[i].error
        return state

    async def _score(
        self, state: RolloutState, outcomes: list[_Outcome], rows: list[tuple[int, int]]
    ) -> None:
        last = {i: r for r, (i, _) in enumerate(rows)}  # each sample's last row
        scored = [r for i, r in last.items() if outcomes[i].error is None and rows[r][1] >= 0]
        dispatcher = EnvDispatcher.from_options(self.task_to_env, self.opts)
        try:
            groups = group_by_task(state.task_names, scored)
            with self.timer.phase("env_startup"):
                await asyncio.to_thread(dispatcher.wait_until_started, groups)
            with self.timer.phase("env_step"):
                results = await asyncio.to_thread(
                    dispatcher.step, groups, state.env_views, state.metadata
                )
        finally:
            dispatcher.shutdown()
        renderer = observation_renderer(self.tokenizer, self.opts.observation_format)
        eos = {r: outcomes[rows[r][0]].session.segments[-1].ended_with_eos for r in scored}
        take_env_results(state, results, eos, self.tokenizer, renderer, self.timer)
        for i, r in last.items():
            reward = outcomes[i].reward
            if reward is not None:
                state.total_reward[r] += reward
                if state.turn_rewards[r]:
                    state.turn_rewards[r][-1] += reward
                else:
                    state.turn_rewards[r].append(reward)
        _share_sample_outcome(state, rows, last)

    def _final_batch(
        self, state: RolloutState, outcomes: list[_Outcome], rows: list[tuple[int, int]]
    ) -> BatchedDataDict[Any]:
        final = slot_rows(
            self.batch.select_indices([i for i, _ in rows]), state, list(range(len(rows)))
        )
        final["agent_sample_index"] = torch.tensor([i for i, _ in rows], dtype=torch.long)
        final["agent_segment"] = torch.tensor([max(j, 0) for _, j in rows], dtype=torch.long)
        final["agent_segment_reason"] = [
            outcomes[i].session.segments[j].reason if j >= 0 else "no request" for i, j in rows
        ]
        final["agent_reward"] = torch.tensor(
            [outcomes[i].reward or 0.0 for i, _ in rows], dtype=torch.float32
        )
        return final


def _rows(outcomes: list[_Outcome]) -> list[tuple[int, int]]:
    """``(sample, segment)`` per row, in sample order; segment -1: the agent made no request."""
    rows = []
    for i, outcome in enumerate(outcomes):
        segments = outcome.session.segments
        rows += [(i, j) for j in range(len(segments))] if segments else [(i, -1)]
    return rows


def _share_sample_outcome(
    state: RolloutState, rows: list[tuple[int, int]], last: dict[int, int]
) -> None:
    """Every row of a sample gets its last row's reward, metadata, status and error."""
    for r, (i, _) in enumerate(rows):
        source = last[i]
        if r == source:
            continue
        state.total_reward[r] = state.total_reward[source]
        state.turn_rewards[r] = list(state.turn_rewards[source])
        for totals in state.components.values():
            totals[r] = totals[source]
        state.component_names[r] = set(state.component_names[source])
        state.terminated[r] = state.terminated[source]
        state.failed[r] = state.failed[source]
        state.errors[r] = state.errors[source]
        state.metadata[r] = state.metadata[source]


def _reward(result: Any) -> tuple[float | None, str | None]:
    if result is None:
        return None, None
    if isinstance(result, bool) or not isinstance(result, (int, float)):
        return None, (
            f"agent returned {type(result).__name__} {result!r:.60}; an agent returns a float "
            "reward (added to the environment's) or None"
        )
    if not math.isfinite(result):
        return None, f"agent returned the reward {result}; rewards must be finite"
    return float(result), None


def _env_message(message: dict[str, Any]) -> dict[str, Any]:
    """A conversation message as environments receive it: ``role`` and ``content`` (and
    ``tool_calls`` for an assistant turn that made some)."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def _datum(batch: BatchedDataDict[Any], i: int) -> dict[str, Any]:
    return {
        key: value[i] for key, value in batch.items() if isinstance(value, (list, torch.Tensor))
    }


def _size(batch: BatchedDataDict[Any]) -> int:
    return len(batch.get("message_log") or [])


def _agent_metrics(outcomes: list[_Outcome], timer: PhaseTimer) -> dict[str, float]:
    n = max(len(outcomes), 1)
    segments = [len(o.session.segments) for o in outcomes]
    return {
        "agent_error_rate": sum(o.error is not None for o in outcomes) / n,
        "agent_timeout_rate": sum(o.timed_out for o in outcomes) / n,
        "segments_per_sample": sum(segments) / n,
        "rewrite_rate": sum(s > 1 for s in segments) / n,
        "timing/agents_s": timer.seconds.get("agents", 0.0),
    }
