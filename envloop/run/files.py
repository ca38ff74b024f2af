"""Reading a run directory written by ``envloop run``: its config, rollouts and metrics.

A run directory holds ``config.yaml`` (the resolved config), ``rollouts.jsonl`` (one JSON
object per sample, in sample order), ``rollouts.parquet``, ``metrics.json``, ``images/``
(the PNG files that image parts of ``rollouts.jsonl`` name, when messages held images) and,
once built, ``report.html``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from envloop.data.jsonl import read_json_objects

CONFIG_FILE = "config.yaml"
ROLLOUTS_FILE = "rollouts.jsonl"
METRICS_FILE = "metrics.json"
IMAGES_DIR = "images"


def run_path(run_dir: str | Path, name: str) -> Path:
    """``run_dir / name``; FileNotFoundError naming the run directory when it is missing."""
    path = Path(run_dir) / name
    if not path.is_file():
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"No run directory at {run_dir} (expected {name} in it).")
        raise FileNotFoundError(
            f"{path} does not exist: is {run_dir} a run directory written by `envloop run`?"
        )
    return path


def load_config(run_dir: str | Path) -> dict[str, Any]:
    """The run's resolved config (``config.yaml``) as a dict."""
    path = run_path(run_dir, CONFIG_FILE)
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping of sections, got {type(config).__name__}.")
    return config


def load_rollouts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every sample's record from ``rollouts.jsonl``, in file order. A line that is not a
    JSON object raises ValueError naming its line number."""
    path = run_path(run_dir, ROLLOUTS_FILE)
    try:
        return [record for _, record in read_json_objects(path)]
    except ValueError as exc:
        raise ValueError(f"{path.parent}: {exc}; expected a JSON object per sample.") from exc


def load_metrics(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``metrics.json``."""
    metrics = json.loads(run_path(run_dir, METRICS_FILE).read_text(encoding="utf-8"))
    if not isinstance(metrics, dict):
        raise ValueError(f"{Path(run_dir) / METRICS_FILE}: expected a JSON object.")
    return metrics


def message_tokens(record: dict[str, Any]) -> int | None:
    """A sample's token count: the sum of its messages' ``num_tokens`` (None if absent)."""
    counts = [m.get("num_tokens") for m in record.get("messages", [])]
    if not counts or any(not isinstance(c, int) for c in counts):
        return None
    return sum(counts)
