"""Reading dataset rows from JSONL, Parquet, a saved Hugging Face dataset, or the hub.

Relative paths in a row (``data.columns.images``) are relative to the data file's folder (a
saved dataset's own folder; the current directory for a hub dataset).

>>> import json, tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "d.jsonl"
>>> _ = path.write_text('{"prompt": "1+1?", "ground_truth": "2"}\\n\\n{"prompt": "2+2?"}\\n')
>>> source = read_source(str(path))
>>> source.columns, source.where(1)
(['prompt', 'ground_truth'], 'row 1 (line 3 of d.jsonl)')
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envloop.config.errors import ConfigError
from envloop.data.jsonl import read_json_objects

FORMATS = ("jsonl", "parquet", "hf_disk", "hf_hub")
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass
class Source:
    """A dataset's rows (dicts, in file order) and where each came from."""

    rows: list[dict[str, Any]]
    name: str  # the file or dataset name, for messages
    line_numbers: list[int] | None = None  # JSONL: the file line of each row
    folder: Path | None = None  # what relative paths in rows are relative to (None: cwd)

    @property
    def columns(self) -> list[str]:
        """Every key of any row, in order of first appearance."""
        return list(dict.fromkeys(key for row in self.rows for key in row))

    def where(self, i: int) -> str:
        """Row ``i`` for error messages: ``row 3 (line 5 of data.jsonl)``."""
        if self.line_numbers is not None:
            return f"row {i} (line {self.line_numbers[i]} of {self.name})"
        return f"row {i} of {self.name}"


def read_source(path: str, fmt: str = "auto", split: str = "train") -> Source:
    """The rows at ``path`` in format ``fmt`` (``auto``: by extension or folder contents,
    else a hub id). Raises :class:`ConfigError` naming ``data.path`` / ``data.split``."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "jsonl":
        return _read_jsonl(Path(path))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return Source(pq.read_table(path).to_pylist(), Path(path).name, folder=Path(path).parent)
    if fmt == "hf_disk":
        from datasets import load_from_disk

        return _from_hf(load_from_disk(path), path, split, Path(path))
    if fmt == "hf_hub":
        from datasets import load_dataset

        return _from_hf(load_dataset(path, split=split), path, split)
    raise ConfigError("data", [f"data.format: {fmt!r} is not one of auto, {', '.join(FORMATS)}"])


def detect_format(path: str) -> str:
    """``jsonl`` / ``parquet`` by extension, ``hf_disk`` for a ``save_to_disk`` folder, else
    ``hf_hub`` (a hub id)."""
    p = Path(path)
    if p.suffix in (".jsonl", ".json"):
        return "jsonl"
    if p.suffix == ".parquet":
        return "parquet"
    if p.is_dir():
        if any((p / marker).exists() for marker in _HF_DISK_MARKERS):
            return "hf_disk"
        raise ConfigError(
            "data", [f"data.path: {path} is a folder but not a saved dataset (save_to_disk)"]
        )
    return "hf_hub"


def _read_jsonl(path: Path) -> Source:
    try:
        numbered = read_json_objects(path)
    except ValueError as exc:
        raise ConfigError("data", [f"data.path: {exc}"]) from exc
    rows, numbers = [row for _, row in numbered], [number for number, _ in numbered]
    return Source(rows, path.name, numbers, path.parent)


def _from_hf(dataset: Any, name: str, split: str, folder: Path | None = None) -> Source:
    """Rows of a ``Dataset``, or of split ``split`` of a ``DatasetDict`` (an Image feature's
    values as its stored ``{"bytes", "path"}`` dicts)."""
    if isinstance(dataset, dict):  # a DatasetDict
        if split not in dataset:
            raise ConfigError(
                "data",
                [f"data.split: {name} has no split {split!r} (splits: {', '.join(dataset)})"],
            )
        dataset = dataset[split]
    return Source(dataset.to_list(), name, folder=folder)
