"""Where a run's prompts come from and how rows become chat messages (the ``data`` section
of the ``envloop run`` config, read by :func:`envloop.data.datasets.load_prompt_samples`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from envloop.config.schema import at_least, meta, option

__all__ = ["ColumnsConfig", "DataConfig"]


@dataclass(kw_only=True)
class ColumnsConfig:
    """Which dataset column holds what."""

    prompt: str = option("prompt", "the prompt: a string, or a list of {role, content} messages")
    ground_truth: str = option("ground_truth", "the reference answer (extra_env_info.ground_truth)")
    task: str | None = option("task", "the task name (a key of envs); null: the only task")
    system_prompt: str | None = option(None, "a per-row system prompt; null: data.system_prompt")
    metadata: str | None = option(None, "a dict merged into the sample's extra_env_info")


@dataclass(kw_only=True)
class DataConfig:
    """Where the prompts come from and how they become chat messages."""

    path: str = option(help="JSONL or Parquet file, saved datasets folder, or hub id")
    format: Literal["auto", "jsonl", "parquet", "hf_disk", "hf_hub"] = option(
        "auto", "auto: from the file extension or folder contents (else a hub id)"
    )
    split: str = option("train", "split of a saved DatasetDict or hub dataset")
    columns: ColumnsConfig = field(default_factory=ColumnsConfig, metadata=meta("column mapping"))
    prompt_template: str = option(
        "{prompt}", "format string for string prompts; {prompt} and any column may appear"
    )
    system_prompt: str | None = option(None, "system message prepended to every prompt")
    limit: int | None = option(None, "use only this many rows (after shuffling)", check=at_least(1))
    shuffle: bool = option(False, "shuffle rows before the limit")
    seed: int = option(0, "shuffle seed")
