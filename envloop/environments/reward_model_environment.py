"""Reward-model environment: a sequence-classification model scores whole conversations.

Each conversation (every message's ``role`` and ``content``) is rendered with the reward
model's own chat template and scored by an ``AutoModelForSequenceClassification`` with one
label (e.g. ``Skywork/Skywork-Reward-V2-Qwen3-0.6B``, or a local folder), on cuda when the
process has a GPU, else on CPU with one torch thread per CPU reserved for the actor
(``resources.num_cpus``, at least 1). The reward is that scalar score; every episode ends
after one step; ``answers`` holds each conversation's last assistant message (``None`` if it
has none); the observation is
``{"role": "environment", "content": "Environment: reward 1.2345"}``.

A conversation longer than ``max_model_len`` tokens is cut from the left (a leading BOS is
kept), so the last turn is always scored, and counted in ``reward_model_env/num_truncated``.
An empty or malformed conversation gets reward 0 and an observation saying why, as does one
whose messages' contents together are longer than ``max_parse_chars`` (``"conversation has
1,200,000 characters, over max_parse_chars=1,000,000; raise max_parse_chars to score it"``):
it is neither templated nor tokenized, so a megabyte-sized response costs nothing to refuse
(its answer is None). The reason is also in the sample's ``metadata["reward_model_error"]``;
``reward_model_env/num_unscored`` and ``num_over_max_parse_chars`` count them; the rest of the
batch is scored as usual (metadata is otherwise returned unchanged). Batches are
fixed-order, length-sorted within a token budget (``dynamic_batching``, see
``reward_model_batching``) or packed rows (``sequence_packing``, see
``reward_model_packing``); padding, batching and packing never change a score. Options,
including which keys of a published NeMo-RL config are honoured and which only warned about:
:mod:`envloop.environments.reward_model.config`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Mapping
from typing import Any

import torch

from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.reward_model.batching import pad_sequences, plan_batches, score_sequences
from envloop.environments.reward_model.checks import warn_unused
from envloop.environments.reward_model.config import (
    RewardModelEnvironmentConfig,
    config_problems,
    reward_model_ray_options,
    validate_config,
)
from envloop.environments.reward_model.loading import load_reward_model
from envloop.environments.reward_model.packing import (
    packing_problem,
    plan_packed_rows,
    score_packed,
)
from envloop.environments.utils import parse_cap_reason
from envloop.models.generation.threads import set_cpu_threads

__all__ = ["RewardModelEnvironment", "RewardModelEnvironmentConfig", "reward_model_ray_options"]
PREFIX = "reward_model_env/"


class RewardModelEnvironment(EnvironmentInterface):
    """Scores conversations with a reward model; see the module docstring."""

    def __init__(self, cfg: RewardModelEnvironmentConfig | None = None) -> None:
        self.config = validate_config(cfg)
        warn_unused(cfg or {})
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            set_cpu_threads(cpu_threads(self.config))
        self.tokenizer, self.model = load_reward_model(self.config, self.device)
        self.pad_id: int = self.model.config.get_text_config().pad_token_id
        packing = self.config["sequence_packing"]["enabled"]
        problem = packing_problem(self.model) if packing else None
        if problem:
            raise ValueError(
                f"reward_model: sequence_packing.enabled is true but {self.config['model_name']!r} "
                f"cannot score packed rows exactly: {problem}. Set sequence_packing.enabled: "
                "false (dynamic_batching gives the same scores)."
            )
        # Counts since the last global_post_process_and_metrics call:
        self.num_truncated = 0
        self.num_unscored = 0  # malformed or over max_parse_chars
        self.num_over_max_parse_chars = 0

    @classmethod
    def actor_options(cls, config: Any) -> dict[str, Any]:
        """The config's ``resources`` as Ray actor options (``num_cpus``, ``num_gpus``;
        ``gpus_per_node`` counts as ``num_gpus``); see :func:`reward_model_ray_options`."""
        return dict(reward_model_ray_options(config))

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (:func:`.reward_model.config.config_problems`)."""
        return config_problems(config)

    def preprocess_data(self, message_logs: list[LLMMessageLogType]) -> BatchedDataDict[Any]:
        """Templated, left-truncated token ids: ``input_ids`` [B, L] right-padded with the pad
        id, ``input_lengths`` [B] int32, ``truncated`` [B] bool. Raises ValueError naming a
        malformed conversation."""
        encoded = [self.encode(log) for log in message_logs]
        input_ids, _ = pad_sequences([ids for ids, _ in encoded], self.pad_id)
        return BatchedDataDict(
            input_ids=input_ids,
            input_lengths=torch.tensor([len(ids) for ids, _ in encoded], dtype=torch.int32),
            truncated=torch.tensor([cut for _, cut in encoded], dtype=torch.bool),
        )

    def encode(self, log: LLMMessageLogType) -> tuple[list[int], bool]:
        """``(token ids, truncated)`` of one conversation; ValueError if it is malformed."""
        if not isinstance(log, list):
            raise ValueError(f"expected a list of messages, got {type(log).__name__}")
        if not log:
            raise ValueError("empty conversation")
        bad = [i for i, message in enumerate(log) if not _is_message(message)]
        if bad:
            raise ValueError(f"message {bad[0]} is not a {{'role': str, 'content': str}} dict")
        too_long = self._cap_reason(log)
        if too_long:
            raise ValueError(too_long)
        messages = [{"role": m["role"], "content": m["content"]} for m in log]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as exc:
            raise ValueError(f"chat template failed ({type(exc).__name__}: {exc})") from exc
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.config["max_model_len"]
        if len(ids) <= limit:
            return ids, False
        keep_bos = ids[0] == self.tokenizer.bos_token_id and limit > 1
        return ids[:1] + ids[len(ids) - limit + 1 :] if keep_bos else ids[-limit:], True

    def _cap_reason(self, log: Any) -> str | None:
        """Why a conversation is not templated nor tokenized: its messages' contents together
        are over ``max_parse_chars`` (None when not, or when ``log`` is malformed)."""
        if not isinstance(log, list) or not all(_is_message(m) for m in log):
            return None
        chars = sum(len(m["content"]) for m in log)
        return parse_cap_reason("conversation", chars, self.config["max_parse_chars"])

    def scoring_plan(self, lengths: list[int]) -> list[list[int]]:
        """Indices scored together in each forward pass: a packed row (``sequence_packing``),
        a length-sorted batch (``dynamic_batching``) or a fixed-order batch of ``batch_size``."""
        packing, dynamic = self.config["sequence_packing"], self.config["dynamic_batching"]
        if packing["enabled"]:
            budget, algorithm = packing["logprob_mb_tokens"], packing["algorithm"]
            order = packing["microbatch_order"]
            return plan_packed_rows(lengths, budget, algorithm, self.round_to, order)
        max_tokens = dynamic["logprob_mb_tokens"] if dynamic["enabled"] else None
        return plan_batches(lengths, self.config["batch_size"], max_tokens, self.round_to)

    @property
    def round_to(self) -> int:
        """The multiple a batch's padded length (or a packed row's length) is rounded up to."""
        for section in ("sequence_packing", "dynamic_batching"):
            if self.config[section]["enabled"]:
                return self.config[section]["sequence_length_round"]
        return 1

    def score(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores [N] float32 of token-id sequences, in input order, grouped by
        :meth:`scoring_plan`."""
        plan = self.scoring_plan([len(s) for s in sequences])
        if self.config["sequence_packing"]["enabled"]:
            return score_packed(self.model, sequences, plan, self.pad_id, self.round_to)
        side = self.tokenizer.padding_side
        return score_sequences(self.model, sequences, plan, self.pad_id, side, self.round_to)

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Score every conversation; all terminate. Rewards [B] float32; a conversation that
        cannot be scored gets 0 and its reason in ``metadata["reward_model_error"]``."""
        if self.model is None:
            raise RuntimeError("RewardModelEnvironment.step after shutdown(); create a new one.")
        results = [self._encode_or_error(log) for log in message_log_batch]
        valid = {i: result for i, result in enumerate(results) if isinstance(result, tuple)}
        rewards = torch.zeros(len(results), dtype=torch.float32)
        if valid:
            rewards[list(valid)] = self.score([ids for ids, _ in valid.values()])
        too_long = [self._cap_reason(log) is not None for log in message_log_batch]
        self.num_truncated += sum(cut for _, cut in valid.values())
        self.num_unscored += len(results) - len(valid)
        self.num_over_max_parse_chars += sum(too_long)
        return EnvironmentReturn(
            observations=[_observation(r, reward) for r, reward in zip(results, rewards.tolist())],
            metadata=[_with_reason(md, r) for md, r in zip(metadata, results)],
            next_stop_strings=[None] * len(results),
            rewards=rewards,
            terminateds=torch.ones(len(results), dtype=torch.bool),
            answers=[
                None if long else _last_assistant(log)
                for log, long in zip(message_log_batch, too_long)
            ],
        )

    def _encode_or_error(self, log: Any) -> tuple[list[int], bool] | str:
        try:
            return self.encode(log)
        except Exception as exc:  # a bad conversation is data, not a crash
            return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """Reward statistics of ``batch["total_reward"]`` (std: population) and the numbers
        of conversations truncated, not scored, and over ``max_parse_chars`` since the
        previous call."""
        rewards = torch.as_tensor(batch.get("total_reward", []), dtype=torch.float32)
        some = rewards if rewards.numel() else torch.zeros(1)
        stats: dict[str, float] = {
            "num_samples": rewards.numel(),
            "num_truncated": self.num_truncated,
            "num_unscored": self.num_unscored,
            "num_over_max_parse_chars": self.num_over_max_parse_chars,
            "mean_reward": some.mean().item(),
            "std_reward": some.std(correction=0).item(),
            "min_reward": some.min().item(),
            "max_reward": some.max().item(),
        }
        self.num_truncated = self.num_unscored = self.num_over_max_parse_chars = 0
        return batch, {PREFIX + key: value for key, value in stats.items()}

    def shutdown(self) -> None:
        """Free the model; later steps raise. Safe to call twice. On cuda also collect garbage
        and empty the allocator's cache (on CPU dropping the reference frees it at once)."""
        if getattr(self, "model", None) is None:
            return
        self.model = None
        if self.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit modules may be gone
            self.shutdown()


def cpu_threads(config: Any) -> int:
    """torch threads of the actor on CPU: one per CPU Ray reserves for it
    (``resources.num_cpus``), at least 1, so it never spins against its neighbours.

    >>> cpu_threads({"resources": {"num_cpus": 4}}), cpu_threads({"resources": {"num_cpus": 0}})
    (4, 1)
    """
    return max(1, int(reward_model_ray_options(config)["num_cpus"]))


def _is_message(message: Any) -> bool:
    if not isinstance(message, dict):
        return False
    return isinstance(message.get("role"), str) and isinstance(message.get("content"), str)


def _with_reason(metadata: Any, encoded: tuple[list[int], bool] | str) -> Any:
    """``metadata`` unchanged for a scored conversation; with ``reward_model_error`` for one
    that was not (a metadata that is not a mapping becomes one)."""
    if not isinstance(encoded, str):
        return metadata
    return {**(metadata if isinstance(metadata, Mapping) else {}), "reward_model_error": encoded}


def _observation(encoded: tuple[list[int], bool] | str, reward: float) -> dict[str, str]:
    if isinstance(encoded, str):
        return {"role": "environment", "content": f"Environment: reward 0 (not scored: {encoded})"}
    return {"role": "environment", "content": f"Environment: reward {reward:.4f}"}


def _last_assistant(log: Any) -> str | None:
    for message in reversed(log if isinstance(log, list) else []):
        if _is_message(message) and message["role"] == "assistant":
            return message["content"]
    return None
