"""Reading JSONL files whose every line is a JSON object, with line numbers for errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_objects(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line; ``ValueError`` naming the file and
    line of the first line that is not a JSON object."""
    path = Path(path)
    out = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number} of {path.name} is not valid JSON ({exc})") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"line {number} of {path.name} is not a JSON object")
            out.append((number, obj))
    return out
