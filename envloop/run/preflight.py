"""What ``envloop run`` checks before it starts Ray: the prompts load, the policy's tokenizer
loads, and every prompt fits ``rollout.max_seq_len``, rendered with the policy's
``chat_template`` and ``chat_template_kwargs`` as the rollout renders it.

It imports transformers' tokenizer classes but not torch (the tokenizer is loaded as
:mod:`envloop.models.tokenizer_classes` describes), Ray, the policy model or the rollout
engine, so a run that cannot work fails in about a second; :func:`envloop.run.runner.run` takes
the result as its ``inputs``.

A dataset with images (``data.columns.images``) needs the policy's multimodal processor,
loaded first (a text-only policy is an error naming both keys). Every image is loaded and
checked, and every prompt is tokenized by the processor, so its length counts each image's
expanded placeholder tokens exactly; this imports torch (the processor returns tensors), and
the tokenized prompts, vision inputs included, are kept for the rollout.
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
    prompt_message_logs,
    prompt_token_ids,
)
from envloop.run.config import RunConfig
from envloop.run.config_sections import PolicyConfig, ServerPolicyConfig

MAX_SHOWN = 5


@dataclass
class RunInputs:
    """The checked inputs of a run."""

    samples: list[PromptSample]  # the dataset rows selected
    tokenizer: Any  # the policy's tokenizer (its processor for images), as the policy loads it
    token_ids: list[list[list[int]]]  # per sample, per prompt message: its templated token ids
    seconds: float  # how long loading and tokenizing took
    message_logs: list[Any] | None = None  # with images: the tokenized prompts, vision inputs too

    def rollout_batch(self, config: RunConfig) -> Any:
        """The rollout input (a BatchedDataDict, one row per prompt x generation; imports
        torch)."""
        stops = {task: env.stop_strings for task, env in config.envs.items()}
        gens = config.rollout.generations_per_prompt
        return build_rollout_batch(
            self.samples, self.tokenizer, gens, stops, self.token_ids, self.message_logs
        )


def prepare_inputs(config: RunConfig) -> RunInputs:
    """The prompts of ``config`` loaded and tokenized (with ``data.columns.images``, by the
    policy's processor, loaded first: :func:`load_policy_processor`), checked against the
    config. Raises :class:`ConfigError` naming the key to change (``data.*``,
    ``policy.model_name`` / ``policy.tokenizer_name``, ``rollout.max_seq_len``)."""
    started = time.perf_counter()
    tasks = {task: env.needs_ground_truth() for task, env in config.envs.items()}
    images = config.data.columns.images
    processor = load_policy_processor(config.policy, images) if images is not None else None
    samples = load_prompt_samples(config.data, tasks)
    logs = None
    if processor is None:
        tokenizer = load_policy_tokenizer(config.policy)
        token_ids = prompt_token_ids(samples, tokenizer)
    else:
        tokenizer, logs = processor, prompt_message_logs(samples, processor)
        token_ids = [[m["token_ids"].tolist() for m in log] for log in logs]
    lengths = [sum(map(len, messages)) for messages in token_ids]
    rows = [s.idx for s in samples]
    problem = prompt_length_problem(lengths, rows, config.rollout.max_seq_len)
    if problem:
        raise ConfigError("run config", [problem])
    return RunInputs(samples, tokenizer, token_ids, time.perf_counter() - started, logs)


def load_policy_tokenizer(policy: PolicyConfig) -> Any:
    """The tokenizer ``policy.tokenizer_name`` (by default ``policy.model_name``) names, or
    with ``backend: server`` ``policy.tokenizer``, with the policy's ``chat_template`` and
    ``chat_template_kwargs``. Raises OSError starting with the key given when it cannot be
    loaded (e.g. a hub id without network access), or ``policy.chat_template`` when its
    file is missing."""
    from envloop.models.tokenizers import get_tokenizer

    key, name = _tokenizer_key(policy)
    try:
        tokenizer = get_tokenizer({"name": name})
    except (OSError, ValueError) as exc:
        raise OSError(f"{key}: {_one_line(str(exc))}") from exc
    return _with_chat_template(tokenizer, policy)


def _with_chat_template(tokenizer: Any, policy: PolicyConfig) -> Any:
    """``tokenizer`` (or processor) with the policy's chat template settings."""
    from envloop.models.tokenizers import apply_chat_template_settings

    try:
        return apply_chat_template_settings(
            tokenizer, policy.chat_template, policy.chat_template_kwargs
        )
    except FileNotFoundError as exc:
        raise OSError(f"policy.chat_template: {_one_line(str(exc))}") from exc


def load_policy_processor(policy: PolicyConfig, images_column: str) -> Any:
    """The multimodal processor ``policy`` generates with, for a dataset whose column
    ``images_column`` holds images (as HfGeneration loads it: the model must be a
    vision-language one, the processor comes from ``policy.tokenizer_name``). Raises
    :class:`ConfigError` naming ``data.columns.images`` and the policy key when the policy
    cannot take images: a text-only model, no processor, or a server dialect that takes
    none (vLLM). For ``backend: server`` the model is the one ``policy.tokenizer`` names."""
    from envloop.data.multimodal_utils import is_processor
    from envloop.models.bundled import resolve_model
    from envloop.models.generation.hf_models import is_vision_language
    from envloop.models.processors import load_processor

    images = f"data.columns.images: column {images_column!r} holds images"
    fix = "or set data.columns.images: null for text-only prompts"
    if isinstance(policy, ServerPolicyConfig):
        from envloop.models.generation.server_dialects import DIALECTS

        refused = DIALECTS[policy.dialect].images_refused
        if refused:
            raise ConfigError(
                "run config",
                [f"{images}, but policy.dialect {policy.dialect!r} cannot send them: {refused}; "
                 f"{fix}"],
            )  # fmt: skip
        model_key, model_name = "policy.tokenizer", policy.tokenizer
    else:
        model_key, model_name = "policy.model_name", policy.model_name
    try:
        vision_language = is_vision_language(model_name)
    except (OSError, ValueError) as exc:
        vision_language, why = False, _one_line(str(exc))
    else:
        why = "its config has no vision part"
    if not vision_language:
        raise ConfigError(
            "run config",
            [f"{images}, but {model_key} {model_name!r} is not a vision-language "
             f"model ({why}); name one (e.g. Qwen/Qwen2.5-VL-3B-Instruct), {fix}"],
        )  # fmt: skip
    key, name = _tokenizer_key(policy)
    try:
        processor = load_processor(resolve_model(name))
    except (OSError, ValueError) as exc:
        why = _one_line(str(exc))
    else:
        if is_processor(processor):
            return _with_chat_template(processor, policy)
        why = f"it loads as {type(processor).__name__}, a text tokenizer"
    raise ConfigError(
        "run config",
        [f"{images}, but {key} {name!r} has no image processor ({why}); point it at the "
         "vision-language model's folder or hub id (preprocessor_config.json and the "
         f"tokenizer), {fix}"],
    )  # fmt: skip


def _tokenizer_key(policy: PolicyConfig) -> tuple[str, str]:
    """The key naming the policy's tokenizer (as the user set it) and its value."""
    if isinstance(policy, ServerPolicyConfig):
        return "policy.tokenizer", policy.tokenizer
    given = "tokenizer_name" in policy.model_fields_set and policy.tokenizer_name is not None
    key = "policy.tokenizer_name" if given else "policy.model_name"
    return key, str(policy.tokenizer_name)


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
