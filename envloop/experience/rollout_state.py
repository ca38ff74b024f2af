"""The per-sample state of a batched rollout, and the steps of the turn loop
(docs/contract.md, "Rollout semantics") that update it."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.llm_message_utils import require_token_ids
from envloop.data.multimodal_utils import text_tokenizer
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.env_dispatch import GroupResult
from envloop.experience.observation_tokens import tokenize_observations
from envloop.experience.phase_timer import PhaseTimer
from envloop.experience.sample_vision import SampleVision
from envloop.experience.token_buffer import TokenBuffer
from envloop.experience.turn_steps import (
    Responses,
    assistant_message,
    check_generation_output,
    cut_content,
    fit_observation,
    observation_text,
    split_owned,
    split_response_rows,
    split_responses,
)


@dataclass
class RolloutState:
    """Everything the engine tracks per sample (B of them) while a rollout runs.

    Tensors are [B]; lists have B entries. ``done`` samples take no further turns.
    """

    message_logs: list[list[dict]]
    env_views: list[list[dict]]  # role/content only: what environments receive
    metadata: list[Any]
    stop_strings: list[list[str] | None]
    task_names: list[str]
    tokens: TokenBuffer
    total_reward: torch.Tensor  # float32
    turn_rewards: list[list[float]]  # each sample's reward per turn
    turns: torch.Tensor  # int64
    gen_tokens: torch.Tensor  # int64, generated tokens so far
    env_tokens: torch.Tensor  # int64, observation tokens so far
    terminated: torch.Tensor  # bool, ended by its environment
    truncated: torch.Tensor  # bool, reached max_seq_len
    failed: torch.Tensor  # bool, its environment step raised or timed out
    errors: list[str | None]  # the failure text of failed samples
    generation_failed: torch.Tensor  # bool, the policy could not generate its response
    generation_errors: list[str | None]  # the failure text of those samples
    sample_ids: list[str]  # a key per sample, unique across rollouts (server affinity)
    min_version: torch.Tensor  # int64, oldest policy version of a generated token; -1: none
    max_version: torch.Tensor  # int64, newest policy version of a generated token; -1: none
    vision: SampleVision  # each sample's images' vision inputs (prompt and observations)
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # "reward/<name>" totals
    component_names: list[set[str]] = field(default_factory=list)  # each sample's own names

    @property
    def size(self) -> int:
        return len(self.message_logs)

    @property
    def done(self) -> torch.Tensor:
        """[B] bool: terminated, truncated, or failed (environment or generation)."""
        return self.terminated | self.truncated | self.failed | self.generation_failed

    def active_indices(self) -> torch.Tensor:
        """[b] int64 indices of the samples that take another turn."""
        return (~self.done).nonzero().flatten()

    @classmethod
    def start(cls, batch: BatchedDataDict[Any], tokenizer: Any, max_seq_len: int) -> RolloutState:
        """Validate ``batch`` and set up state; the batch itself is never mutated."""
        n = len(batch.get("message_log") or [])  # load() reports a missing or bad column
        state = cls.empty(n, tokenizer, max_seq_len)
        state.load(list(range(n)), batch)
        return state

    @classmethod
    def empty(cls, size: int, tokenizer: Any, max_seq_len: int) -> RolloutState:
        """``size`` slots with no sample yet: :meth:`load` puts samples in them."""
        pad_id = _pad_id(text_tokenizer(tokenizer))
        return cls(
            message_logs=[[] for _ in range(size)],
            env_views=[[] for _ in range(size)],
            metadata=[None] * size,
            stop_strings=[None] * size,
            task_names=[""] * size,
            tokens=TokenBuffer([_EMPTY] * size, max_seq_len, pad_id),
            total_reward=torch.zeros(size, dtype=torch.float32),
            turn_rewards=[[] for _ in range(size)],
            turns=torch.zeros(size, dtype=torch.long),
            gen_tokens=torch.zeros(size, dtype=torch.long),
            env_tokens=torch.zeros(size, dtype=torch.long),
            terminated=torch.zeros(size, dtype=torch.bool),
            truncated=torch.zeros(size, dtype=torch.bool),
            failed=torch.zeros(size, dtype=torch.bool),
            errors=[None] * size,
            generation_failed=torch.zeros(size, dtype=torch.bool),
            generation_errors=[None] * size,
            sample_ids=[""] * size,
            min_version=torch.full((size,), -1, dtype=torch.long),
            max_version=torch.full((size,), -1, dtype=torch.long),
            vision=SampleVision(size),
            component_names=[set() for _ in range(size)],
        )

    def load(self, slots: list[int], batch: BatchedDataDict[Any]) -> None:
        """Validate ``batch`` (one row per slot) and start its samples in ``slots``, which
        forget whatever sample they held (new objects throughout: rows taken from the
        slots earlier keep their values). The batch itself is never mutated."""
        logs, task_names = _checked_logs_and_tasks(batch)
        n = len(logs)
        if len(slots) != n:
            raise ValueError(f"{n} samples for {len(slots)} slots")
        prompts = [torch.cat([m["token_ids"] for m in log]) if log else _EMPTY for log in logs]
        _check_prompt_lengths(prompts, self.tokens.max_seq_len)
        stop_strings = list(batch.get("stop_strings") or [None] * n)
        _check_stop_strings(stop_strings, n)
        metadata = list(batch.get("extra_env_info") or [None] * n)
        if len(metadata) != n:
            raise ValueError(
                f"'extra_env_info' has {len(metadata)} entries for {n} samples; give one per "
                "sample (None where a sample has no metadata)."
            )
        # Written through numpy: a few µs, not 20 torch calls.
        rows = np.asarray(slots, dtype=np.int64)
        for tensor in (
            self.total_reward, *self.components.values(), self.turns, self.gen_tokens,
            self.env_tokens, self.terminated, self.failed, self.generation_failed,
        ):  # fmt: skip
            tensor.numpy()[rows] = 0
        self.min_version.numpy()[rows] = -1
        self.max_version.numpy()[rows] = -1
        self.tokens.reset(torch.from_numpy(rows), prompts)
        lengths = self.tokens.lengths.numpy()[rows]
        self.truncated.numpy()[rows] = lengths >= self.tokens.max_seq_len
        ids = _sample_ids(n)
        for k, (i, log) in enumerate(zip(slots, logs)):
            self.message_logs[i] = list(log)
            self.env_views[i] = [{"role": m["role"], "content": m["content"]} for m in log]
            self.metadata[i], self.stop_strings[i] = metadata[k], stop_strings[k]
            self.task_names[i], self.sample_ids[i] = task_names[k], ids[k]
            self.turn_rewards[i], self.component_names[i] = [], set()
            self.errors[i] = self.generation_errors[i] = None
            self.vision.reset(i, log)


_EMPTY = torch.zeros(0, dtype=torch.long)


def _sample_ids(n: int) -> list[str]:
    """``<rollout>:<index>`` keys: one rollout's samples never share another's."""
    rollout = uuid.uuid4().hex[:12]
    return [f"{rollout}:{i}" for i in range(n)]


def check_limits(max_seq_len: int, max_rollout_turns: int) -> None:
    problems = []
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        problems.append(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if not isinstance(max_rollout_turns, int) or max_rollout_turns < 0:
        problems.append(f"max_rollout_turns must be an int >= 0, got {max_rollout_turns!r}")
    if problems:
        raise ValueError("; ".join(problems))


def build_generation_input(state: RolloutState, active: torch.Tensor) -> BatchedDataDict[Any]:
    """Step 1: the active samples' token rows, stop strings and remaining token budgets,
    and their vision inputs (``SampleVision.columns``: both representations of their
    images, or with ``state.vision.reads_images`` set only what the policy reads)."""
    input_ids, input_lengths = state.tokens.rows(active)
    samples = active.tolist()
    return BatchedDataDict(
        input_ids=input_ids,
        input_lengths=input_lengths,
        stop_strings=[state.stop_strings[i] for i in samples],
        max_new_tokens=state.tokens.max_seq_len - input_lengths,
        sample_ids=[state.sample_ids[i] for i in samples],
        **(state.vision.columns(samples) if state.vision.any else {}),
    )


def media_read_by(policy: Any, deduplicate_multimodal_data: bool) -> bool | None:
    """``SampleVision.reads_images`` for a rollout of ``policy``: None (hand over both
    representations of a sample's images) unless ``deduplicate_multimodal_data``; then
    whether the policy reads ``images`` (``GenerationInterface.reads_images``) rather than
    the vision input columns."""
    if not deduplicate_multimodal_data:
        return None
    return bool(getattr(policy, "reads_images", False))


def append_responses(
    state: RolloutState,
    active: torch.Tensor,
    gen_input: BatchedDataDict[Any],
    output: BatchedDataDict[Any],
    tokenizer: Any,
) -> Responses:
    """Step 2: append each active sample's response to its log and token row. A sample
    whose row carries a ``generation_error`` gets no message and is marked failed."""
    check_generation_output(output, len(active))
    responses = split_responses(
        output, gen_input["input_lengths"], gen_input["max_new_tokens"], tokenizer
    )
    record_responses(state, active, responses)
    return responses


def append_response_rows(
    state: RolloutState,
    active: list[int],
    input_lengths: list[int],
    budgets: list[int],
    outputs: list[BatchedDataDict[Any]],
    tokenizer: Any,
) -> Responses:
    """:func:`append_responses` for samples whose responses came back one at a time: the
    one-row output of each of ``active`` (b >= 1 samples), with the prompt length and token
    budget its generation input had. One step for them all, as if they had come in one
    batch."""
    for output in outputs:
        check_generation_output(output, 1)
    responses = split_response_rows(outputs, input_lengths, budgets, tokenizer)
    record_responses(state, torch.tensor(active, dtype=torch.long), responses)
    return responses


def record_responses(state: RolloutState, active: torch.Tensor, responses: Responses) -> None:
    """Append ``responses`` (one per sample of ``active``) to the samples' logs, token rows,
    counters and policy version spans; a response with an error fails its sample."""
    samples = active.tolist()
    for j, i in enumerate(samples):
        if responses.errors[j] is not None:
            state.generation_failed[i] = True
            state.generation_errors[i] = f"generation failed: {responses.errors[j]}"
            continue
        text = responses.texts[j]
        message = assistant_message(
            text, responses.token_ids[j], responses.logprobs[j], responses.versions[j]
        )
        state.message_logs[i].append(message)
        state.env_views[i].append({"role": "assistant", "content": text})
    state.tokens.append_ragged(active, responses.flat_ids, responses.counts)
    rows = active.numpy()  # counters updated in place through numpy: far fewer torch calls
    np.add.at(state.turns.numpy(), rows, [e is None for e in responses.errors])
    np.add.at(state.gen_tokens.numpy(), rows, responses.counts.numpy())
    _record_versions(state, rows, responses)


def _record_versions(state: RolloutState, rows: np.ndarray, responses: Responses) -> None:
    """Widen the policy version span of each sample of ``rows`` (distinct slots) by its
    response's."""
    low, high = responses.min_versions.numpy(), responses.max_versions.numpy()
    generated = low >= 0
    if not generated.any():
        return
    rows, low, high = rows[generated], low[generated], high[generated]
    min_version, max_version = state.min_version.numpy(), state.max_version.numpy()
    old_low = min_version[rows]
    min_version[rows] = np.where(old_low < 0, low, np.minimum(old_low, low))
    max_version[rows] = np.maximum(max_version[rows], high)


def record_rewards(state: RolloutState, results: Sequence[GroupResult]) -> None:
    """Step 4: add each group's rewards to the totals; mark failed groups' samples."""
    for group in results:
        if group.result is None:
            _mark_failed(state, group.indices, group.error or "environment step failed")
            continue
        idx = torch.tensor(group.indices, dtype=torch.long)
        total = _add_reward_components(state, idx, group.result.rewards)
        state.total_reward.index_add_(0, idx, total)
        for i, reward in zip(group.indices, total.tolist()):
            state.turn_rewards[i].append(reward)


def append_observations(
    state: RolloutState,
    results: Sequence[GroupResult],
    ended_with_eos: dict[int, bool],
    tokenizer: Any,
    renderer: ObservationRenderer | None,
) -> None:
    """Step 5: tokenize every observation (text-only ones in one call), cut to fit, append
    to logs and rows. An observation with images keeps its vision inputs; one that does not
    fit whole is dropped (its sample is truncated, so the policy never reads it). One that
    cannot be tokenized fails its sample only."""
    items = [
        (i, group.result.observations[j])
        for group in results
        if group.result is not None
        for j, i in enumerate(group.indices)
    ]
    tokenized = tokenize_observations(
        tokenizer, [(obs, renderer, ended_with_eos[i]) for i, obs in items]
    )
    lengths = state.tokens.lengths.tolist()
    kept_items, kept_ids, kept_vision = [], [], []
    for (i, obs), (ids, vision, error) in zip(items, tokenized):
        if error is not None:
            state.failed[i] = True
            state.errors[i] = f"observation of task {state.task_names[i]!r}: {error}"
            continue
        kept, truncated = fit_observation(ids, lengths[i], state.tokens.max_seq_len)
        if truncated:
            state.truncated[i] = True
            if vision:  # images cannot be cut: the whole observation goes
                kept, vision = [], {}
            content = text_tokenizer(tokenizer).decode(kept)
            if kept and isinstance(obs["content"], str):  # without the template's markup
                rendered = observation_text(obs, renderer, ended_with_eos[i])
                content = cut_content(rendered, obs["content"], content)
            obs = {"role": obs["role"], "content": content}
        if kept or not truncated:  # an empty observation that fits is still a message
            kept_items.append((i, obs))
            kept_ids.append(kept)
            kept_vision.append(vision)
    if not kept_items:
        return
    rows = torch.tensor([i for i, _ in kept_items], dtype=torch.long)
    counts = [len(ids) for ids in kept_ids]
    flat = torch.tensor(list(itertools.chain.from_iterable(kept_ids)), dtype=torch.long)
    for (i, obs), token_ids, vision in zip(kept_items, split_owned(flat, counts), kept_vision):
        state.env_views[i].append({"role": obs["role"], "content": obs["content"]})
        message = {"role": obs["role"], "content": obs["content"], "token_ids": token_ids}
        message.update(vision)
        state.message_logs[i].append(message)
        state.vision.add(i, message)
    count_tensor = torch.tensor(counts, dtype=torch.long)
    state.tokens.append_ragged(rows, flat, count_tensor)
    state.env_tokens.index_add_(0, rows, count_tensor)


def update_episode_status(state: RolloutState, results: Sequence[GroupResult]) -> None:
    """Step 6: take returned metadata (when not None), next stop strings and terminations."""
    for group in results:
        if group.result is None:
            continue
        ret = group.result
        for j, i in enumerate(group.indices):
            if ret.metadata[j] is not None:
                state.metadata[i] = ret.metadata[j]
            state.stop_strings[i] = ret.next_stop_strings[j]
        idx = torch.tensor(group.indices, dtype=torch.long)
        state.terminated[idx] |= ret.terminateds.bool()


def take_env_results(
    state: RolloutState,
    results: Sequence[GroupResult],
    ended_with_eos: dict[int, bool],
    tokenizer: Any,
    renderer: ObservationRenderer | None,
    timer: PhaseTimer,
) -> None:
    """Steps 4-6 for the samples of ``results``: rewards, observations, episode status
    (each timed in its phase); both engines end a sample's turn with it."""
    with timer.phase("rewards_and_status"):
        record_rewards(state, results)
    with timer.phase("obs_tokenization"):
        append_observations(state, results, ended_with_eos, tokenizer, renderer)
    with timer.phase("rewards_and_status"):
        update_episode_status(state, results)


def observation_renderer(tokenizer: Any, observation_format: str) -> ObservationRenderer | None:
    """What renders observations for ``observation_format`` (None: ``raw``, as is)."""
    return ObservationRenderer(tokenizer) if observation_format == "chat_template" else None


def _add_reward_components(state: RolloutState, idx: torch.Tensor, rewards: Any) -> torch.Tensor:
    if not isinstance(rewards, dict):
        return rewards.detach().to(torch.float32).reshape(-1)
    total = torch.zeros(len(idx), dtype=torch.float32)
    for name, value in rewards.items():
        value = value.detach().to(torch.float32).reshape(-1)
        if name not in state.components:
            state.components[name] = torch.zeros(state.size, dtype=torch.float32)
        state.components[name].index_add_(0, idx, value)
        total += value
    for i in idx.tolist():
        state.component_names[i].update(rewards)
    return total


def _mark_failed(state: RolloutState, indices: list[int], error: str) -> None:
    for i in indices:
        state.failed[i] = True
        state.errors[i] = error
        state.turn_rewards[i].append(0.0)


def _checked_logs_and_tasks(batch: BatchedDataDict[Any]) -> tuple[list[list[dict]], list[str]]:
    missing = [k for k in ("message_log", "task_name") if k not in batch]
    if missing:
        raise ValueError(
            f"The input batch lacks {missing}; a rollout batch needs 'message_log' and "
            "'task_name' per sample (see envloop.data.interfaces.DatumSpec)."
        )
    logs, task_names = batch["message_log"], batch["task_name"]
    if len(logs) != len(task_names):
        raise ValueError(
            f"The input batch has {len(logs)} message logs but {len(task_names)} task names."
        )
    for i, log in enumerate(logs):
        require_token_ids(log, sample_index=i)
    return logs, list(task_names)


def _pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"Tokenizer {type(tokenizer).__name__} has no pad token; set one, e.g. "
            "tokenizer.pad_token = tokenizer.eos_token."
        )
    return int(tokenizer.pad_token_id)


def _check_prompt_lengths(prompts: list[torch.Tensor], max_seq_len: int) -> None:
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (", ..." if len(empty) > 10 else "")
        raise ValueError(
            f"Sample(s) {shown} of the input batch have an empty prompt (an empty message_log, "
            "or messages whose token_ids are all empty), so nothing would condition their "
            "generation. Give each a tokenized prompt (e.g. get_formatted_message_log) or drop "
            "those samples."
        )
    too_long = [(i, len(p)) for i, p in enumerate(prompts) if len(p) > max_seq_len]
    if too_long:
        shown = ", ".join(f"sample {i}: {n} tokens" for i, n in too_long[:5])
        raise ValueError(
            f"max_seq_len={max_seq_len} is smaller than {len(too_long)} prompt(s) ({shown}). "
            "Raise max_seq_len or shorten those prompts."
        )


def _check_stop_strings(stop_strings: list[Any], n: int) -> None:
    if len(stop_strings) != n:
        raise ValueError(f"'stop_strings' has {len(stop_strings)} entries for {n} samples.")
    for i, item in enumerate(stop_strings):
        if item is not None and not (
            isinstance(item, list) and all(isinstance(s, str) and s for s in item)
        ):
            raise ValueError(
                f"stop_strings[{i}] is {item!r}; each entry must be None or a list of "
                "non-empty strings, e.g. ['</call>']."
            )
