"""The tokenizer class ``AutoTokenizer`` picks for a local folder, remembered between runs.

``AutoTokenizer`` chooses the class from the folder's ``tokenizer_config.json`` and model
config, and its module imports torch on the way (about 2 s with transformers). The class it
picks usually does not need torch. So envloop remembers each folder's class, keyed by the
transformers version and the size and modification time of the folder's tokenizer and
config files, and a later load of the same folder calls that class's ``from_pretrained``
directly: the same tokenizer as ``AutoTokenizer`` would give, without importing torch. This
is what lets ``envloop run`` measure prompt lengths in about a second.

The memory is a JSON file in ``$ENVLOOP_CACHE_DIR`` (default ``~/.cache/envloop``). A file
that cannot be read or written is ignored: loading then goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CACHE_DIR_VARIABLE", "cache_file", "remember_class", "remembered_class"]

CACHE_DIR_VARIABLE = "ENVLOOP_CACHE_DIR"
KEY_FILES = (
    "config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files whose change may change the class AutoTokenizer picks, or the tokenizer."""
MAX_ENTRIES = 256


def cache_file() -> Path:
    """Where the remembered classes are kept."""
    root = os.environ.get(CACHE_DIR_VARIABLE) or Path.home() / ".cache" / "envloop"
    return Path(root) / "tokenizer_classes.json"


def remembered_class(folder: str | Path) -> type | None:
    """The class remembered for ``folder``, or None (never seen, or a file has changed)."""
    name = _read().get(_key(folder))
    if not isinstance(name, str) or not name.startswith("transformers."):
        return None  # only transformers' own classes are imported from the file
    module, _, qualname = name.partition(":")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def remember_class(folder: str | Path, cls: type) -> None:
    """Remember that ``AutoTokenizer`` loaded ``folder`` as ``cls`` (a transformers class;
    others are not remembered)."""
    if not cls.__module__.startswith("transformers."):
        return
    entries, key = _read(), _key(folder)
    entries.pop(key, None)  # re-added last: the newest entries are kept
    entries[key] = f"{cls.__module__}:{cls.__qualname__}"
    _write(dict(list(entries.items())[-MAX_ENTRIES:]))


def _key(folder: str | Path) -> str:
    path = Path(folder).resolve()
    stamps = []
    for name in KEY_FILES:
        with contextlib.suppress(OSError):
            stat = (path / name).stat()
            stamps.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    version = importlib.metadata.version("transformers")
    return "|".join([f"transformers {version}", str(path), *stamps])


def _read() -> dict[str, Any]:
    try:
        entries = json.loads(cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write(entries: dict[str, str]) -> None:
    """Replace the file atomically, so concurrent runs never read half of one."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
        ) as handle:
            json.dump(entries, handle, indent=0)
        os.replace(handle.name, path)
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(handle.name)
