"""Where a run's prompts come from and how rows become chat messages (the ``data`` section
of the ``envloop run`` config, read by :func:`envloop.data.datasets.load_prompt_samples`)."""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from pydantic import Field

from envloop.config.validation import Config, NonEmptyStr

__all__ = ["DATA_FORMATS", "ColumnsConfig", "DataConfig", "DataFormat"]

DataFormat = Literal["auto", "jsonl", "parquet", "hf_disk", "hf_hub"]
DATA_FORMATS: tuple[str, ...] = typing.get_args(DataFormat)


class ColumnsConfig(Config, title="data columns"):
    """Which dataset column holds what."""

    prompt: NonEmptyStr = "prompt"
    """The prompt: a string, or a list of ``{role, content}`` messages."""
    ground_truth: NonEmptyStr = "ground_truth"
    """The reference answer (``extra_env_info.ground_truth``)."""
    task: NonEmptyStr | None = "task"
    """The task name (a key of ``envs``); None: the only task."""
    system_prompt: NonEmptyStr | None = None
    """A per-row system prompt; None: ``data.system_prompt``."""
    metadata: NonEmptyStr | None = None
    """A dict merged into the sample's ``extra_env_info``."""
    images: NonEmptyStr | None = None
    """Images put before the text of the first user message: one or a list of file paths
    (relative to the data file's folder), encoded bytes or ``datasets`` Image values; ``[]``:
    none for that row. Needs a vision-language policy. None: a text-only dataset."""


class DataConfig(Config, title="data"):
    """Where the prompts come from and how they become chat messages."""

    path: NonEmptyStr
    """JSONL or Parquet file, saved datasets folder, or hub id."""
    format: DataFormat = "auto"
    """``auto``: from the file extension or folder contents (else a hub id)."""
    split: NonEmptyStr = "train"
    """Split of a saved DatasetDict or hub dataset."""
    columns: ColumnsConfig = ColumnsConfig()
    """Which column holds what."""
    prompt_template: str = "{prompt}"
    """Format string for string prompts; ``{prompt}`` and any column may appear."""
    system_prompt: str | None = None
    """System message prepended to every prompt."""
    limit: Annotated[int, Field(ge=1)] | None = None
    """Use only this many rows (after shuffling)."""
    shuffle: bool = False
    """Shuffle rows before the limit."""
    seed: int = 0
    """Shuffle seed."""
