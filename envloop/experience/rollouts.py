"""The rollout engine: a policy against environments for one or many turns
(docs/contract.md, "Rollout semantics" and "Failures are data").

``run_multi_turn_rollout`` runs each turn as the numbered steps of docs/contract.md,
"Rollout semantics":

1. flatten the active samples' tokens (:func:`build_generation_input`) and generate;
2. append each response to its log (:func:`append_responses`);
3. step every task group's environment concurrently (:class:`EnvDispatcher`);
4. add rewards to the totals (:func:`record_rewards`);
5. tokenize and append observations, cut to fit (:func:`append_observations`);
6. update metadata, stop strings and which samples are done (:func:`update_episode_status`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.llm_message_utils import get_keys_from_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.interfaces import EnvironmentReturn
from envloop.experience.async_rollouts import FinishedGroup, FinishedSample, RolloutStream
from envloop.experience.env_dispatch import (
    EnvDispatcher,
    EnvironmentStepError,
    GroupResult,
    check_tasks_have_envs,
    group_by_task,
)
from envloop.experience.experience_stream import ExperienceStream
from envloop.experience.phase_timer import PhaseTimer
from envloop.experience.rollout_call import RolloutCall
from envloop.experience.rollout_groups import (
    run_async_multi_turn_rollout_groups as run_async_multi_turn_rollout_groups,
)
from envloop.experience.rollout_metrics import RolloutProgress, rollout_metrics, rollout_progress
from envloop.experience.rollout_options import (
    DEFAULTS,
    AsyncRolloutOptions,
    ObservationFormat,
    OnEnvError,
    RolloutOptions,
    options_from_arguments,
)
from envloop.experience.rollout_results import final_rows
from envloop.experience.rollout_state import (
    RolloutState,
    append_responses,
    build_generation_input,
    check_limits,
    media_read_by,
    observation_renderer,
    take_env_results,
)
from envloop.experience.turn_steps import assistant_message, split_responses
from envloop.models.generation.interfaces import GenerationInterface

__all__ = [
    "EnvironmentStepError",
    "ExperienceStream",
    "FinishedGroup",
    "FinishedSample",
    "RolloutProgress",
    "RolloutStream",
    "calculate_rewards",
    "generate_responses",
    "run_async_multi_turn_rollout",
    "run_multi_turn_rollout",
]


def run_multi_turn_rollout(
    policy_generation: GenerationInterface,
    input_batch: BatchedDataDict[Any],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
    *,
    observation_format: ObservationFormat = DEFAULTS.observation_format,
    env_step_timeout_s: float | None = DEFAULTS.env_step_timeout_s,
    env_startup_timeout_s: float | None = DEFAULTS.env_startup_timeout_s,
    on_env_error: OnEnvError = DEFAULTS.on_env_error,
    env_max_retries: int = DEFAULTS.env_max_retries,
    on_turn: Callable[[RolloutProgress], None] | None = None,
    **unknown: Any,
) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
    """Run every sample until its environment ends it, it reaches ``max_seq_len``, or
    ``max_rollout_turns`` turns have passed.

    Args:
        policy_generation: the policy.
        input_batch: ``DatumSpec`` columns; ``message_log`` messages carry ``token_ids``.
        tokenizer: the policy's tokenizer (decodes responses, tokenizes observations).
        task_to_env: task name -> environment (a Ray actor handle or an in-process object).
        max_seq_len: no sample ever exceeds this many tokens.
        max_rollout_turns: turns (generation + environment step) per sample at most.
        greedy: greedy decoding instead of sampling.
        deduplicate_multimodal_data: hand the policy only the representation of each
            sample's images it reads (``GenerationInterface.reads_images``), not both the
            vision input columns and ``images``; the final batch is the same.
        observation_format, env_step_timeout_s, env_startup_timeout_s, on_env_error,
            env_max_retries, on_turn: the rollout options, each described in
            :class:`~envloop.experience.rollout_options.RolloutOptions`; any other keyword
            fails with a ``ConfigError`` that names the closest option.

    Returns:
        ``(final_batch, metrics)``: the input batch (not mutated) with extended
        ``message_log``, updated ``extra_env_info`` and ``loss_multiplier``, and
        ``total_reward`` [B] float32, ``truncated`` / ``terminated`` [B] bool,
        ``num_turns`` [B] int64, ``turn_rewards`` (per sample, one float per turn),
        ``env_error`` (per sample, None or the failure text of its environment step),
        ``generation_error`` (likewise, for a response the policy could not generate),
        and ``reward/<name>`` [B] float32 totals for component rewards (0 where a sample's
        environment returned no such component; ``reward_components`` lists, per sample,
        the names its own environment returned), and ``min_policy_version`` /
        ``max_policy_version`` [B] int64: the oldest and newest policy version among the
        sample's generated tokens (-1 for a sample that generated none; each assistant
        message's ``generation_policy_versions`` [n] int32 holds every token's).
    """
    opts = options_from_arguments(RolloutOptions, locals(), unknown)
    check_limits(max_seq_len, max_rollout_turns)
    state = RolloutState.start(input_batch, tokenizer, max_seq_len)
    check_tasks_have_envs(state.task_names, task_to_env)
    renderer = observation_renderer(tokenizer, opts.observation_format)
    dispatcher = EnvDispatcher.from_options(task_to_env, opts)
    timer = PhaseTimer()
    regenerated = getattr(policy_generation, "generation_retries", 0)  # lost workers' rows
    state.vision.reads_images = media_read_by(policy_generation, opts.deduplicate_multimodal_data)
    try:
        for _ in range(max_rollout_turns):
            active = state.active_indices()
            if len(active) == 0:
                break
            _run_turn(
                state, active, policy_generation, tokenizer, dispatcher, renderer, greedy, timer
            )
            if opts.on_turn is not None:
                opts.on_turn(rollout_progress(state, timer))
    finally:
        dispatcher.shutdown()
    max_turns_reached = ~state.done
    metrics = rollout_metrics(state, max_turns_reached, timer)
    regenerated = getattr(policy_generation, "generation_retries", 0) - regenerated
    retries = {
        "total_env_step_retries": dispatcher.retries,
        "total_generation_retries": regenerated,
    }
    return final_rows(input_batch, state), {**metrics, **retries}


def run_async_multi_turn_rollout(
    policy_generation: GenerationInterface,
    input_batch: BatchedDataDict[Any],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
    *,
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
) -> RolloutCall:
    """:func:`run_multi_turn_rollout` with every sample running its own turn loop: a sample
    generates, steps its environment and goes on the moment its own previous step is done
    (see :mod:`envloop.experience.async_rollouts`). Same arguments, outputs and metrics;
    with greedy decoding and deterministic environments, the same trajectories.

    Called as NeMo-RL's function is, from synchronous code,
    ``final, metrics = run_async_multi_turn_rollout(...)`` runs the rollout on an event loop
    of its own and returns when it is done. Inside an event loop, ``final, metrics = await
    run_async_multi_turn_rollout(...)`` (unpacking it there without ``await`` raises a
    ``RuntimeError`` that says so); ``asyncio.run(run_async_multi_turn_rollout(...))`` works
    too (see :class:`~envloop.experience.rollout_call.RolloutCall`).

    The options are those of ``run_multi_turn_rollout`` plus ``max_concurrent_samples``,
    ``coalesce_window_s`` and ``max_coalesced_samples``
    (:class:`~envloop.experience.rollout_options.AsyncRolloutOptions`), checked when the
    call is made. To use samples or GRPO groups as they finish, iterate over a
    :class:`RolloutStream` instead; this function runs one to its end and returns the batch
    in input order.
    """
    opts = options_from_arguments(AsyncRolloutOptions, locals(), unknown)
    stream = RolloutStream(
        policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, max_rollout_turns,
        greedy, **dict(opts),
    )  # fmt: skip
    return RolloutCall(_run_to_end(stream))


async def _run_to_end(stream: RolloutStream) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
    async for _ in stream:
        pass
    return stream.final_batch(), stream.metrics()


def _run_turn(
    state: RolloutState,
    active: torch.Tensor,
    policy: GenerationInterface,
    tokenizer: Any,
    dispatcher: EnvDispatcher,
    renderer: ObservationRenderer | None,
    greedy: bool,
    timer: PhaseTimer,
) -> None:
    with timer.phase("flatten"):
        gen_input = build_generation_input(state, active)
    with timer.phase("generation"):
        output = policy.generate(gen_input, greedy=greedy)
    with timer.phase("gen_bookkeeping"):
        responses = append_responses(state, active, gen_input, output, tokenizer)
    generated = active[~state.generation_failed[active]].tolist()
    groups = group_by_task(state.task_names, generated)
    with timer.phase("env_startup"):
        dispatcher.wait_until_started(groups)
    with timer.phase("env_step"):
        results = dispatcher.step(groups, state.env_views, state.metadata)
    ended_with_eos = dict(zip(active.tolist(), responses.ended_with_eos))
    take_env_results(state, results, ended_with_eos, tokenizer, renderer, timer)


def generate_responses(
    policy_generation: GenerationInterface,
    generation_input_data: BatchedDataDict[Any],
    batch: BatchedDataDict[Any],
    tokenizer: Any,
    input_lengths: torch.Tensor,
    include_logprobs: bool = True,
    greedy: bool = False,
) -> tuple[BatchedDataDict[Any], list[torch.Tensor], dict[str, float | int]]:
    """Generate one response per sample and append it to ``batch["message_log"]`` in place.

    Returns ``(batch, generated_ids, metrics)``: ``generated_ids`` holds each sample's
    generated tokens ([n_i] int64); metrics are ``mean_generation_length`` and
    ``total_generated_tokens``.
    """
    output = policy_generation.generate(generation_input_data, greedy=greedy)
    responses = split_responses(output, input_lengths, None, tokenizer)
    for i, log in enumerate(batch["message_log"]):
        logprobs = responses.logprobs[i] if include_logprobs else None
        versions = responses.versions[i]
        log.append(
            assistant_message(responses.texts[i], responses.token_ids[i], logprobs, versions)
        )
    total = int(responses.counts.sum())
    metrics = {
        "mean_generation_length": total / max(len(responses.texts), 1),
        "total_generated_tokens": total,
    }
    return batch, responses.token_ids, metrics


def calculate_rewards(
    batch: BatchedDataDict[Any], task_to_env: dict[str, Any]
) -> EnvironmentReturn:
    """Step each sample's environment once and return the results in batch order.

    Rewards are a [B] tensor when every environment returns a tensor; when any returns
    components, a dict of every ``reward/<name>`` ([B], 0 where a sample's environment
    lacks it), with plain rewards under ``reward/scalar``. Errors raise
    :class:`EnvironmentStepError`.
    """
    task_names = list(batch["task_name"])
    check_tasks_have_envs(task_names, task_to_env)
    env_logs = [get_keys_from_message_log(log, ("role", "content")) for log in batch["message_log"]]
    metadata = list(batch.get("extra_env_info") or [None] * len(env_logs))
    dispatcher = EnvDispatcher(task_to_env, on_error="raise")
    try:
        results = dispatcher.step(
            group_by_task(task_names, list(range(len(env_logs)))), env_logs, metadata
        )
    finally:
        dispatcher.shutdown()
    return _merge_env_returns(results, len(env_logs))


def _merge_env_returns(results: list[GroupResult], n: int) -> EnvironmentReturn:
    observations: list[Any] = [None] * n
    metadata: list[Any] = [None] * n
    stop_strings: list[Any] = [None] * n
    answers: list[Any] = [None] * n
    terminateds = torch.zeros(n, dtype=torch.bool)
    scalar = torch.zeros(n, dtype=torch.float32)
    components: dict[str, torch.Tensor] = {}
    for group in results:
        ret, idx = group.result, group.indices
        assert ret is not None  # on_error="raise" never leaves a result empty
        for j, i in enumerate(idx):
            observations[i], metadata[i] = ret.observations[j], ret.metadata[j]
            stop_strings[i] = ret.next_stop_strings[j]
            answers[i] = ret.answers[j] if ret.answers is not None else None
        terminateds[idx] = ret.terminateds.bool()
        rewards = ret.rewards if isinstance(ret.rewards, dict) else {"reward/scalar": ret.rewards}
        for name, value in rewards.items():
            components.setdefault(name, torch.zeros(n, dtype=torch.float32))[idx] = value.float()
    merged: Any = components
    if set(components) <= {"reward/scalar"}:
        merged = components.get("reward/scalar", scalar)
    return EnvironmentReturn(observations, metadata, stop_strings, merged, terminateds, answers)
