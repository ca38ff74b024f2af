"""``check_env``: run an environment once and report every contract violation together."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import is_actor
from envloop.environments.contract import (
    NONFINITE_HINT,
    coerce_env_return,
    env_return_problems,
    nonfinite_rewards,
)
from envloop.environments.interfaces import EnvironmentReturn


class EnvironmentContractError(ValueError):
    """An environment broke the ``EnvironmentInterface`` contract; ``problems`` lists how."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{name} breaks the environment contract:\n{lines}")


class MissingMetadataError(EnvironmentContractError):
    """``step`` raised ``KeyError`` for a key that no sample's metadata has: the samples,
    not the environment, are at fault. ``key`` is the missing key, ``present`` the keys the
    samples' metadata does have."""

    def __init__(self, name: str, key: Any, present: list[str], problem: str) -> None:
        self.problems, self.key, self.present = [problem], key, present
        ValueError.__init__(
            self,
            f"{name}.step needs sample metadata key {key!r}, which none of the samples has "
            f"(their metadata keys: {', '.join(present) or 'none'}); {problem}. Give samples "
            f"whose metadata has {key!r}.",
        )


def check_env(
    env: Any, sample_message_logs: list[LLMMessageLogType], sample_metadata: list[Any]
) -> EnvironmentReturn:
    """Call ``env.step`` (an instance or a Ray actor handle) on the samples and check the
    result: field lengths, dtypes, reward shapes and keys, observation keys, stop-string
    types, samples whose step failed (``errors``), rewards that are NaN or infinite; then
    ``global_post_process_and_metrics`` on a batch built from the result.

    Returns the ``EnvironmentReturn``; raises :class:`EnvironmentContractError` listing
    every problem found.
    """
    name = _name(env)
    if len(sample_message_logs) != len(sample_metadata):
        raise ValueError(
            f"check_env: {len(sample_message_logs)} message logs but {len(sample_metadata)} "
            "metadata entries; give one of each per sample."
        )
    logs = [
        [{"role": m["role"], "content": m["content"]} for m in log] for log in sample_message_logs
    ]
    try:
        ret = coerce_env_return(_call(env, "step", logs, list(sample_metadata)))
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc  # a Ray actor's error wraps the original
        key = _missing_metadata_key(cause, sample_metadata)
        if key is not None:
            problem = f"step raised: {_short(cause)}"
            present = _metadata_keys(sample_metadata)
            raise MissingMetadataError(name, key, present, problem) from exc
        raise EnvironmentContractError(name, [f"step raised: {_short(exc)}"]) from exc
    problems = env_return_problems(ret, len(logs))
    if not problems:
        problems = _sample_failures(ret) + [
            f"sample {i}: {what}; {NONFINITE_HINT}" for i, what in nonfinite_rewards(ret).items()
        ]
        problems += _post_process_problems(env, logs, sample_metadata, ret)
    if problems:
        raise EnvironmentContractError(name, problems)
    return ret


def _sample_failures(ret: EnvironmentReturn) -> list[str]:
    """One line per sample whose step failed (``errors``), with the first line of why."""
    errors = ret.errors or []
    return [f"sample {i}: {text.splitlines()[0]}" for i, text in enumerate(errors) if text]


def _post_process_problems(
    env: Any, logs: list[LLMMessageLogType], metadata: list[Any], ret: EnvironmentReturn
) -> list[str]:
    rewards = ret.rewards
    total = sum(rewards.values()) if isinstance(rewards, dict) else rewards
    batch: BatchedDataDict[Any] = BatchedDataDict(
        message_log=[[*log, obs] for log, obs in zip(logs, ret.observations)],
        extra_env_info=[
            new if new is not None else old for new, old in zip(ret.metadata, metadata)
        ],
        total_reward=torch.as_tensor(total, dtype=torch.float32),
    )
    try:
        out = _call(env, "global_post_process_and_metrics", batch)
    except Exception as exc:
        return [f"global_post_process_and_metrics raised: {_short(exc)}"]
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        return ["global_post_process_and_metrics must return (batch, metrics dict)"]
    bad = [k for k, v in out[1].items() if not isinstance(k, str) or not _is_number(v)]
    return [f"metrics: {k!r} is not a str -> number entry" for k in bad]


def _missing_metadata_key(exc: BaseException, metadata: list[Any]) -> Any:
    """The key of ``exc``, a ``KeyError``, when no metadata dict has it; else None."""
    if not (isinstance(exc, KeyError) and len(exc.args) == 1):
        return None
    key = exc.args[0]
    dicts = [md for md in metadata if isinstance(md, dict)]
    try:
        return key if not any(key in md for md in dicts) else None
    except TypeError:  # an unhashable key cannot be a metadata key
        return None


def _metadata_keys(metadata: list[Any]) -> list[str]:
    keys = {str(k) for md in metadata if isinstance(md, dict) for k in md}
    return sorted(keys)


def _call(env: Any, method: str, *args: Any) -> Any:
    if is_actor(env):
        import ray

        return ray.get(getattr(env, method).remote(*args))
    return getattr(env, method)(*args)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or value is None


def _name(env: Any) -> str:
    if is_actor(env):
        return f"actor {env._ray_actor_creation_function_descriptor.class_name}"
    return type(env).__name__


def _short(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
