"""The files of a run directory: ``config.yaml``, ``rollouts.jsonl``, ``rollouts.parquet``,
``metrics.json`` and ``images/`` (layout: :mod:`envloop.run.files`, which reads them back).

``rollouts.parquet`` holds the JSONL columns (``rewards`` and ``extra_env_info`` as JSON
strings ``rewards_json`` / ``extra_env_info_json``, since their keys vary by task;
``initial_extra_env_info`` likewise) plus per-token columns a trainer reads directly,
aligned with ``input_ids``: ``generation_logprobs`` (0 outside generated tokens),
``generation_policy_versions`` (each generated token's policy version; 0 elsewhere),
``loss_mask`` (1 on generated tokens) and ``message_token_counts``. A message whose content
is a list of parts has its text parts joined in ``content`` and the parts themselves in
``parts_json`` (null for a string content). The image columns (empty or null without
images): ``images`` (each image's lossless PNG bytes, in message order), ``image_messages``
(each image's message index) and ``image_grid_thw`` (each image's ``[t, h, w]`` patch grid;
see :mod:`envloop.run.records`). Both rollout files are appended batch by batch; each image
is written once to ``images/`` under its content name, before the first line naming it.
``envloop run`` writes both files at its end (and when it stops on a signal) from the
run's journal (:mod:`envloop.run.journal`), in sample order (:func:`write_rollouts`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from envloop.data.multimodal_utils import content_text_parts
from envloop.run.files import CONFIG_FILE, IMAGES_DIR, METRICS_FILE, ROLLOUTS_FILE
from envloop.run.records import IMAGE_KEYS, PARQUET_ONLY_KEYS, image_file_name, jsonable

PARQUET_FILE = "rollouts.parquet"
_JSON_COLUMNS = ("rewards", "extra_env_info", "initial_extra_env_info")
_MESSAGE = pa.struct(
    [("role", pa.string()), ("content", pa.string()), ("num_tokens", pa.int32()),
     ("reward", pa.float64()), ("parts_json", pa.string())]
)  # fmt: skip
PARQUET_SCHEMA = pa.schema(
    [
        ("sample", pa.int64()), ("idx", pa.int64()), ("task", pa.string()),
        ("generation", pa.int64()), ("messages", pa.list_(_MESSAGE)),
        ("total_reward", pa.float64()), ("rewards_json", pa.string()),
        ("turn_rewards", pa.list_(pa.float64())), ("num_turns", pa.int64()),
        ("truncated", pa.bool_()), ("terminated", pa.bool_()), ("error", pa.string()),
        ("loss_multiplier", pa.float64()), ("min_policy_version", pa.int64()),
        ("max_policy_version", pa.int64()), ("ground_truth", pa.string()),
        ("extra_env_info_json", pa.string()), ("initial_extra_env_info_json", pa.string()),
        ("input_ids", pa.list_(pa.int64())),
        ("generation_logprobs", pa.list_(pa.float32())),
        ("generation_policy_versions", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
        ("message_token_counts", pa.list_(pa.int32())),
        ("images", pa.list_(pa.binary())), ("image_messages", pa.list_(pa.int32())),
        ("image_grid_thw", pa.list_(pa.list_(pa.int64()))),
    ]
)  # fmt: skip
_IMAGE_FILE = re.compile(r"[0-9a-f]{16}\.png")


class RunWriter:
    """Writes one run directory; use as a context manager, ``add`` each batch's records
    (:func:`envloop.run.records.sample_records`), then ``write_metrics``. ``keep_images``:
    the images already in ``images/`` are this run's (else they are removed)."""

    def __init__(self, run_dir: str | Path, *, keep_images: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in (ROLLOUTS_FILE, PARQUET_FILE, METRICS_FILE, "report.html"):
            (self.run_dir / name).unlink(missing_ok=True)
        self._images: set[str] = set()
        for path in (self.run_dir / IMAGES_DIR).glob("*.png"):
            if not _IMAGE_FILE.fullmatch(path.name):
                continue
            if keep_images:  # written already (by the run's journal)
                self._images.add(f"{IMAGES_DIR}/{path.name}")
            else:  # an earlier run's images
                path.unlink()
        self._jsonl = (self.run_dir / ROLLOUTS_FILE).open("w", encoding="utf-8")
        self._parquet = pq.ParquetWriter(self.run_dir / PARQUET_FILE, PARQUET_SCHEMA)

    def write_config(self, config: dict[str, Any]) -> None:
        """``config.yaml``: the resolved config, sections in order."""
        write_config(self.run_dir, config)

    def add(self, records: list[dict[str, Any]]) -> None:
        """Append records to both rollout files (flushed, so a crash keeps what is done),
        after writing the images they name that are not written yet."""
        for record in records:
            self._write_images(record.get("images", ()))
        for record in records:
            line = {k: v for k, v in record.items() if k not in PARQUET_ONLY_KEYS}
            self._jsonl.write(json.dumps(line, ensure_ascii=False) + "\n")
        self._jsonl.flush()
        if records:
            rows = [_parquet_row(r) for r in records]
            self._parquet.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA))

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        """``metrics.json``."""
        write_metrics(self.run_dir, metrics)

    def close(self) -> None:
        self._jsonl.close()
        self._parquet.close()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_images(self, pngs: Any) -> None:
        for png in pngs:
            name = image_file_name(png)
            if name not in self._images:
                (self.run_dir / IMAGES_DIR).mkdir(exist_ok=True)
                (self.run_dir / name).write_bytes(png)
                self._images.add(name)


def write_config(run_dir: str | Path, config: dict[str, Any]) -> None:
    """``config.yaml``: the resolved config, sections in order."""
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    (Path(run_dir) / CONFIG_FILE).write_text(text, encoding="utf-8")


def write_metrics(run_dir: str | Path, metrics: dict[str, Any]) -> None:
    """``metrics.json``."""
    text = json.dumps(jsonable(metrics), indent=2)
    (Path(run_dir) / METRICS_FILE).write_text(text + "\n", encoding="utf-8")


def write_rollouts(
    run_dir: str | Path, records: Iterable[dict[str, Any]], chunk: int = 256
) -> list[dict[str, Any]]:
    """``rollouts.jsonl`` and ``rollouts.parquet`` of ``records`` (in sample order, e.g.
    :meth:`envloop.run.journal.RunJournal.records`), appended ``chunk`` at a time; the
    images in ``images/`` are kept. Returns the records as ``rollouts.jsonl`` holds them
    (without the Parquet-only columns)."""
    lines: list[dict[str, Any]] = []
    part: list[dict[str, Any]] = []
    with RunWriter(run_dir, keep_images=True) as writer:
        for record in records:
            part.append(record)
            lines.append({k: v for k, v in record.items() if k not in PARQUET_ONLY_KEYS})
            if len(part) == chunk:
                writer.add(part)
                part = []
        writer.add(part)
    return lines


def read_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """The samples of ``rollouts.parquet``, shaped as the records that were written (the
    JSONL records, ``rewards`` and ``extra_env_info`` decoded, ``reward`` only on messages
    that have one) plus the token columns ``input_ids``, ``generation_logprobs``,
    ``loss_mask``, ``message_token_counts`` and, on samples with images, the image columns
    ``images``, ``image_messages``, ``image_grid_thw``.
    """
    path = Path(run_dir) / PARQUET_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a run directory?")
    records = []
    for row in pq.read_table(path).to_pylist():
        for name in _JSON_COLUMNS:
            row[name] = json.loads(row.pop(f"{name}_json"))
        row["messages"] = [_read_message(m) for m in row["messages"]]
        if not row.get("images"):
            for name in IMAGE_KEYS:
                row.pop(name, None)
        records.append(row)
    return records


def _parquet_row(record: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in record.items() if k not in _JSON_COLUMNS}
    for name in _JSON_COLUMNS:
        row[f"{name}_json"] = json.dumps(record[name], ensure_ascii=False)
    row["messages"] = [_parquet_message(m) for m in record["messages"]]
    return {"images": [], "image_messages": [], "image_grid_thw": None, **row}


def _parquet_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message["content"]
    if not isinstance(content, list):
        return {**message, "reward": message.get("reward"), "parts_json": None}
    parts = json.dumps(content, ensure_ascii=False)
    return {**message, "content": content_text_parts(content), "parts_json": parts,
            "reward": message.get("reward")}  # fmt: skip


def _read_message(message: dict[str, Any]) -> dict[str, Any]:
    parts = message.pop("parts_json")
    if parts is not None:
        message["content"] = json.loads(parts)
    return {k: v for k, v in message.items() if k != "reward" or v is not None}
