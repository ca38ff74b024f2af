"""What ``envloop run`` checks before it starts Ray: the prompts load, the policy's tokenizer
loads, and every prompt fits ``rollout.max_seq_len``.

It imports transformers' tokenizer classes but not torch (the tokenizer is loaded as
:mod:`envloop.models.tokenizer_classes` describes), Ray, the policy model or the rollout
engine, so a run that cannot work fails in about a second; :func:`envloop.run.runner.run` takes
the result as its ``inputs``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from envloop.config.errors import ConfigError
from envloop.data.datasets import (
    PromptSample,
    build_rollout_batch,
    load_prompt_samples,
    prompt_token_ids,
)
from envloop.run.config import RunConfig
from envloop.run.config_sections import PolicyConfig, ServerPolicyConfig

MAX_SHOWN = 5


@dataclass
class RunInputs:
    """The checked inputs of a run."""

    samples: list[PromptSample]  # the dataset rows selected
    tokenizer: Any  # the policy's tokenizer, as the policy loads it
    token_ids: list[list[list[int]]]  # per sample, per prompt message: its templated token ids
    seconds: float  # how long loading and tokenizing took

    def rollout_batch(self, config: RunConfig) -> Any:
        """The rollout input (a BatchedDataDict, one row per prompt x generation; imports
        torch)."""
        stops = {task: env.stop_strings for task, env in config.envs.items()}
        gens = config.rollout.generations_per_prompt
        return build_rollout_batch(self.samples, self.tokenizer, gens, stops, self.token_ids)


def prepare_inputs(config: RunConfig) -> RunInputs:
    """The prompts of ``config`` loaded and tokenized, checked against the config. Raises
    :class:`ConfigError` naming the key to change (``data.*``, ``policy.model_name`` /
    ``policy.tokenizer_name``, ``rollout.max_seq_len``)."""
    started = time.perf_counter()
    tasks = {task: env.needs_ground_truth() for task, env in config.envs.items()}
    samples = load_prompt_samples(config.data, tasks)
    tokenizer = load_policy_tokenizer(config.policy)
    token_ids = prompt_token_ids(samples, tokenizer)
    lengths = [sum(map(len, messages)) for messages in token_ids]
    rows = [s.idx for s in samples]
    problem = prompt_length_problem(lengths, rows, config.rollout.max_seq_len)
    if problem:
        raise ConfigError("run config", [problem])
    return RunInputs(samples, tokenizer, token_ids, time.perf_counter() - started)


def load_policy_tokenizer(policy: PolicyConfig) -> Any:
    """The tokenizer ``policy.tokenizer_name`` (by default ``policy.model_name``) names, or
    with ``backend: server`` ``policy.tokenizer``. Raises OSError starting with the key
    given when it cannot be loaded (e.g. a hub id without network access)."""
    from envloop.models.tokenizers import get_tokenizer

    if isinstance(policy, ServerPolicyConfig):
        key, name = "policy.tokenizer", policy.tokenizer
    else:
        given = "tokenizer_name" in policy.model_fields_set and policy.tokenizer_name is not None
        key = "policy.tokenizer_name" if given else "policy.model_name"
        name = policy.tokenizer_name
    try:
        return get_tokenizer({"name": name})
    except (OSError, ValueError) as exc:
        raise OSError(f"{key}: {_one_line(str(exc))}") from exc


def prompt_length_problem(lengths: list[int], rows: list[int], max_seq_len: int) -> str | None:
    """The problem when some prompts (``lengths`` in tokens, of dataset rows ``rows``) are
    longer than ``max_seq_len``, or None.

    >>> print(prompt_length_problem([7, 30, 30, 12], [0, 1, 1, 2], 10))
    ... # doctest: +NORMALIZE_WHITESPACE
    rollout.max_seq_len: 10 is smaller than 2 prompts (row 1: 30 tokens, row 2: 12 tokens);
    set rollout.max_seq_len to at least 30 plus room for the responses, or shorten those prompts
    >>> prompt_length_problem([7], [0], 10) is None
    True
    """
    longest = dict(sorted({r: n for r, n in zip(rows, lengths) if n > max_seq_len}.items()))
    if not longest:
        return None
    shown = ", ".join(f"row {r}: {n} tokens" for r, n in list(longest.items())[:MAX_SHOWN])
    more = f", ... {len(longest) - MAX_SHOWN} more" if len(longest) > MAX_SHOWN else ""
    noun = "prompt" if len(longest) == 1 else "prompts"
    return (
        f"rollout.max_seq_len: {max_seq_len} is smaller than {len(longest)} {noun} "
        f"({shown}{more}); set rollout.max_seq_len to at least {max(longest.values())} plus "
        "room for the responses, or shorten those prompts"
    )


def _one_line(text: str) -> str:
    return " ".join(text.split())
