"""Whether a run directory's finished samples may be kept by ``envloop run CONFIG --resume``.

A resumed run keeps the finished samples and rolls out only the others, so it must roll
them out as the first run did: the same prompts (:func:`input_fingerprint`) and a config
that differs at most in keys that change no result (:data:`RESULT_NEUTRAL_KEYS`: where Ray
runs, start-up timeouts, the resources Ray reserves). Any other difference refuses to
resume, naming each key with its recorded and new value.

>>> old = {"policy": {"max_new_tokens": 8, "startup_timeout_s": 60.0}, "ray": {"num_cpus": 2}}
>>> new = {"policy": {"max_new_tokens": 16, "startup_timeout_s": 90.0}, "ray": {"num_cpus": 4}}
>>> result_changes(old, new)
['policy.max_new_tokens: 8 -> 16']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop.config.errors import ConfigError

RESULT_NEUTRAL_KEYS = (
    "ray.",
    "output.dir",
    "rollout.env_startup_timeout_s",
    "policy.startup_timeout_s",
    "policy.worker_num_cpus",
    "policy.worker_num_gpus",
    "policy.worker_placement",
    "policy.worker_startup_timeout_s",
    "envs.*.num_cpus",
    "envs.*.placement",
)
"""Config keys (``ray.`` and its like: every key under it) a resumed run may change: they
decide where and when the work runs, not what it computes. Any other change (the model,
sampling, limits, environments, data, batch size, rollout mode, ...) refuses to resume."""


def result_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` (values as JSON) for each dotted key whose value differs between
    two resolved configs, except :data:`RESULT_NEUTRAL_KEYS`; a key only one of them has
    shows ``(absent)`` on the other side; a mapping on both sides is compared key by key."""
    changes: list[str] = []
    _compare(old, new, "", changes)
    return changes


def _compare(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str, out: list[str]) -> None:
    for key in sorted(old.keys() | new.keys(), key=str):
        a, b, path = old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            _compare(a, b, f"{path}.", out)
        elif a != b and not _neutral(path):
            out.append(f"{path}: {_shown(a)} -> {_shown(b)}")


def check_resumable(
    run_dir: str | Path,
    recorded: Mapping[str, Any],
    config: Mapping[str, Any],
    recorded_inputs: str,
    inputs: str,
) -> None:
    """ConfigError naming every result-changing difference between the config the
    journal of ``run_dir`` recorded and ``config``, and a change of the prompts
    (fingerprints ``recorded_inputs`` and ``inputs``)."""
    problems = result_changes(recorded, config)
    if recorded_inputs != inputs:
        problems.append(
            "data: the prompts differ from those the run started with (data.path's rows, "
            "their selection or their tokenization changed)"
        )
    if problems:
        problems.append(
            f"--resume keeps {run_dir}'s finished samples only for the config they were "
            "rolled out with: restore the keys above, or run without --resume to start "
            "over (or set output.dir to a new directory)"
        )
        raise ConfigError("config for --resume", problems)


def input_fingerprint(samples: list[Any], token_ids: list[Any]) -> str:
    """SHA-256 of the prompts a run rolls out (each ``PromptSample``'s row index, task,
    messages, ground truth and extra env info, images by their bytes) and their token
    ids."""
    digest = hashlib.sha256()
    for sample, ids in zip(samples, token_ids, strict=True):
        row = [sample.idx, sample.task, sample.messages, sample.ground_truth,
               sample.extra_env_info, ids]  # fmt: skip
        digest.update(json.dumps(_stable(row), sort_keys=True).encode())
        digest.update(b"\n")
    return digest.hexdigest()


_ABSENT = object()


def _neutral(key: str) -> bool:
    parts = key.split(".")
    for pattern in RESULT_NEUTRAL_KEYS:
        if pattern.endswith("."):
            if key.startswith(pattern) or key == pattern[:-1]:
                return True
            continue
        wanted = pattern.split(".")
        if len(parts) == len(wanted) and all(w in ("*", p) for w, p in zip(wanted, parts)):
            return True
    return False


def _shown(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, default=str)


def _stable(value: Any) -> Any:
    """``value`` as JSON the same way in every process: images (PIL) and bytes by a hash
    of their contents."""
    if isinstance(value, Mapping):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes") and hasattr(value, "size") and hasattr(value, "mode"):
        pixels = hashlib.sha256(value.tobytes()).hexdigest()
        return f"image:{value.mode}:{list(value.size)}:{pixels}"
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return repr(value)
