"""One record per sample of a finished rollout batch: what ``rollouts.jsonl`` and
``rollouts.parquet`` hold.

Prompt messages keep their original text (not the chat-templated text they were tokenized
as); each observation carries the reward of the turn that produced it. ``rewards`` holds the
``reward/<name>`` component totals that the sample's own environment returned (a batch
column of a component only another task's environment returns is left out). The token
columns (:data:`TOKEN_KEYS`) are the whole sequence the policy saw and produced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict

TOKEN_KEYS = ("input_ids", "generation_logprobs", "loss_mask", "message_token_counts")
"""Per-token columns: Parquet only."""


def sample_records(final: BatchedDataDict[Any], first_sample: int = 0) -> list[dict[str, Any]]:
    """Records of the samples of ``final`` (a ``run_multi_turn_rollout`` result whose input
    came from :func:`envloop.data.datasets.build_rollout_batch`), numbered from
    ``first_sample``."""
    components = sorted(k for k in final if k.startswith("reward/"))
    return [
        _record(final, i, first_sample + i, components) for i in range(len(final["message_log"]))
    ]


def jsonable(value: Any) -> Any:
    """``value`` with tensors, tuples and other non-JSON values made JSON-safe (NaN and
    infinities become None)."""
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _record(
    final: BatchedDataDict[Any], i: int, sample: int, components: list[str]
) -> dict[str, Any]:
    log = final["message_log"][i]
    messages, tokens = _messages(log, final["prompt_messages"][i], final["turn_rewards"][i])
    return {
        "sample": sample,
        "idx": int(final["idx"][i]),
        "task": final["task_name"][i],
        "generation": int(final["generation"][i]),
        "messages": messages,
        "total_reward": float(final["total_reward"][i]),
        "rewards": {name: float(final[name][i]) for name in _own(final, i, components)},
        "turn_rewards": [float(r) for r in final["turn_rewards"][i]],
        "num_turns": int(final["num_turns"][i]),
        "truncated": bool(final["truncated"][i]),
        "terminated": bool(final["terminated"][i]),
        "error": final["env_error"][i] or final["generation_error"][i],
        "loss_multiplier": float(final["loss_multiplier"][i]),
        "ground_truth": final["ground_truth"][i],
        "extra_env_info": jsonable(final["extra_env_info"][i]),
        "initial_extra_env_info": jsonable(final["initial_extra_env_info"][i]),
        **tokens,
    }


def _messages(
    log: list[dict[str, Any]], prompt: list[dict[str, str]], turn_rewards: list[float]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages of one sample and its token columns."""
    messages, turn = [], -1
    ids, logprobs, mask = [], [], []
    for j, message in enumerate(log):
        token_ids = message["token_ids"]
        generated = "generation_logprobs" in message
        entry: dict[str, Any] = {
            "role": message["role"],
            "content": prompt[j]["content"] if j < len(prompt) else message["content"],
            "num_tokens": len(token_ids),
        }
        if generated:
            turn += 1
        elif j >= len(prompt) and 0 <= turn < len(turn_rewards):
            entry["reward"] = float(turn_rewards[turn])
        messages.append(entry)
        ids.append(token_ids)
        logprobs.append(
            message["generation_logprobs"] if generated else torch.zeros(len(token_ids))
        )
        mask.append(torch.full((len(token_ids),), int(generated), dtype=torch.int8))
    tokens = {
        "input_ids": torch.cat(ids).tolist() if ids else [],
        "generation_logprobs": torch.cat(logprobs).float().tolist() if logprobs else [],
        "loss_mask": torch.cat(mask).tolist() if mask else [],
        "message_token_counts": [m["num_tokens"] for m in messages],
    }
    return messages, tokens


def _own(final: BatchedDataDict[Any], i: int, components: list[str]) -> list[str]:
    """The components sample ``i``'s environment returned (all of them for a batch that
    does not say, e.g. one from an older engine)."""
    names = final.get("reward_components")
    return components if names is None else [c for c in components if c in names[i]]
