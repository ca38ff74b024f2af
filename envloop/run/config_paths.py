"""Whether a config value naming a model, tokenizer, dataset or checkpoint is a local path,
a hub id or ``bundled:<name>``, and the one-line problem when it cannot be what it says.

A value is a **local path** when it starts with ``/``, ``./``, ``../`` or ``~``, has more
than one ``/`` or a ``\\``, or exists relative to the current directory. Anything else is
a **hub id**: ``name`` or ``org/name``, each part letters, digits, ``-``, ``_`` and ``.``,
not starting or ending with ``-`` or ``.``, without ``--`` or ``..``, at most 96 characters
(the hub's own rules). Nothing here touches the network or imports heavy modules.

>>> is_local_path("./model"), is_local_path("Qwen/Qwen3-0.6B"), is_local_path("a/b/c")
(True, False, True)
>>> is_hub_id("Qwen/Qwen3-0.6B"), is_hub_id("bad..name"), is_hub_id("-x")
(True, False, False)
>>> model_problem("policy.model_name", "/nonexistent")  # doctest: +NORMALIZE_WHITESPACE
"policy.model_name: no such folder: '/nonexistent' (read as a local path; hub ids look like
org/name, e.g. Qwen/Qwen3-0.6B). Set policy.model_name to an existing model folder, a hub id or
bundled:<name> (policy, policy_early, reward_model, vlm_policy, judge)."
"""

from __future__ import annotations

import re
from pathlib import Path

from envloop.models.bundled import BUNDLED_NAMES, BUNDLED_PREFIX, resolve_model

HUB_ID_MAX_LEN = 96
_HUB_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_PATH_STARTS = ("/", "./", "../", "~", ".\\", "..\\")
_HUB_RULES = (
    "hub id (org/name or name: letters, digits, '-', '_' and '.', not starting or ending "
    "with '-' or '.', no '--' or '..')"
)
_BUNDLED = f"{BUNDLED_PREFIX}<name> ({', '.join(BUNDLED_NAMES)})"


def is_local_path(value: str) -> bool:
    """Whether ``value`` names a local file or folder rather than a hub id (module docstring)."""
    return (
        value.startswith(_PATH_STARTS)
        or value in (".", "..")
        or value.count("/") > 1
        or "\\" in value
        or Path(value).exists()
    )


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is a well-formed hub id, ``name`` or ``org/name``."""
    parts = value.split("/")
    return (
        0 < len(value) <= HUB_ID_MAX_LEN
        and len(parts) <= 2
        and all(_HUB_PART.match(p) and "--" not in p and ".." not in p for p in parts)
    )


def model_problem(key: str, value: str) -> str | None:
    """The problem with ``value`` as the model or tokenizer at ``key`` (a folder, a hub id or
    ``bundled:<name>``), or None when it may load."""
    if value.startswith(BUNDLED_PREFIX):
        try:
            resolve_model(value)
        except (ValueError, FileNotFoundError) as exc:
            return f"{key}: {exc}"
        return None
    fix = f"Set {key} to an existing model folder, a hub id or {_BUNDLED}."
    if is_local_path(value):
        folder = Path(value).expanduser()
        if folder.is_dir():
            return None
        what = "is a file, not a model folder" if folder.exists() else "no such folder"
        return (
            f"{key}: {what}: {value!r} (read as a local path; hub ids look like org/name, "
            f"e.g. Qwen/Qwen3-0.6B). {fix}"
        )
    if not is_hub_id(value):
        return f"{key}: {value!r} is neither an existing folder nor a valid {_HUB_RULES}. {fix}"
    return None


def file_problem(key: str, value: str, what: str) -> str | None:
    """The problem with ``value`` as the local file at ``key`` (``what`` it should be), or
    None when the file exists."""
    path = Path(value).expanduser()
    if path.is_file():
        return None
    found = "is a folder, not a file" if path.exists() else "no such file"
    return f"{key}: {found}: {value!r}. Set {key} to an existing {what}, or null."


def dataset_problem(key: str, value: str, fmt: str) -> str | None:
    """The problem with ``value`` as the dataset at ``key`` read as ``fmt`` (``auto``, a file
    format, ``hf_disk`` or ``hf_hub``), or None when it may load."""
    if fmt == "hf_hub":
        bad = not is_hub_id(value)
        return f"{key}: {value!r} is not a valid dataset {_HUB_RULES}." if bad else None
    if Path(value).expanduser().exists():
        return None
    fix = (
        f"Set {key} to a .jsonl or .parquet file, a folder saved with save_to_disk, or a hub "
        "dataset id (org/name)."
    )
    if fmt != "auto" or is_local_path(value) or Path(value).suffix in _FILE_SUFFIXES:
        return (
            f"{key}: no such file or folder: {value!r} (relative paths are looked up in the "
            f"current directory, then next to the config file). {fix}"
        )
    if not is_hub_id(value):
        return (
            f"{key}: {value!r} is neither an existing file or folder nor a valid "
            f"{_HUB_RULES}. {fix}"
        )
    return None
