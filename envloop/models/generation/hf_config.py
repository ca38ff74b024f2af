"""The settings of the transformers backend (:class:`HfGenerationConfig`), declared once and
validated on construction with every problem reported. Imports no torch: ``envloop run``
checks them before it starts anything."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from envloop.config import validation
from envloop.models.generation.threads import DEFAULT_CPU_THREADS

Device = Literal["cpu", "cuda", "auto"]
DType = Literal["float32", "bfloat16", "float16"]


@validation.config_dataclass("HfGenerationConfig")
class HfGenerationConfig:
    """Settings of :class:`~envloop.models.generation.hf_generation.HfGeneration`.

    >>> HfGenerationConfig(model_name="Qwen/Qwen3-0.6B", top_p=0.9).tokenizer_name
    'Qwen/Qwen3-0.6B'
    >>> HfGenerationConfig(model_name="m", temperature=0, num_workers=0)
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid HfGenerationConfig:
      - temperature: must be > 0, got 0
      - num_workers: must be >= 1, got 0
    """

    model_name: validation.NonEmptyStr
    """Local folder, hub id or ``bundled:<name>`` (see :mod:`envloop.models.bundled`), loaded
    with ``AutoModelForCausalLM.from_pretrained``."""
    tokenizer_name: validation.NonEmptyStr | None = None
    """Folder, hub id or ``bundled:<name>`` of the tokenizer; None uses ``model_name``."""
    device: Device = "cpu"
    """``cpu``, ``cuda``, or ``auto`` (cuda when available, else cpu)."""
    dtype: DType = "float32"
    """Weights dtype."""
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    """Logits are divided by it before top-k/top-p filtering (for argmax, generate with
    ``greedy=True``)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass; 1 keeps every token."""
    top_k: Annotated[int, Field(ge=1)] | None = None
    """Keep only the k most likely tokens; None keeps all."""
    max_new_tokens: Annotated[int, Field(ge=1)] = 512
    """Most tokens generated per sample; a per-sample budget in the batch may lower it."""
    micro_batch_size: Annotated[int, Field(ge=1)] = 8
    """Rows decoded together in one forward pass (per worker)."""
    seed: Annotated[int, Field(ge=0)] = 0
    """Seeds the sampling generator; worker ``i`` uses ``seed + i``."""
    num_workers: Annotated[int, Field(ge=1)] = 1
    """1: generate in this process. N > 1: N Ray actors, each with its own model copy."""
    worker_num_cpus: Annotated[float, Field(ge=0)] = 1.0
    """CPUs Ray reserves for each worker actor (``num_workers > 1`` only)."""
    worker_num_gpus: Annotated[float, Field(ge=0)] = 0.0
    """GPUs Ray reserves for each worker actor; must be > 0 for ``device='cuda'`` workers."""
    cpu_threads: Annotated[int, Field(ge=1)] | None = DEFAULT_CPU_THREADS
    """torch threads of the process that generates on CPU (this one, or each worker actor);
    process-wide (see :mod:`~envloop.models.generation.threads`). None: torch's default (one
    per core), fastest only on an otherwise idle machine. Ignored on cuda."""

    def __post_init__(self) -> None:
        if self.tokenizer_name is None:
            object.__setattr__(self, "tokenizer_name", self.model_name)

    @model_validator(mode="after")
    def _workers_have_gpus(self) -> HfGenerationConfig:
        if self.num_workers > 1 and self.device in ("cuda", "auto") and not self.worker_num_gpus:
            raise ValueError(
                f"worker_num_gpus: 0 gives the {self.num_workers} workers no GPU for device="
                f"{self.device!r}; set it (e.g. 1) or use device='cpu'"
            )
        return self

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> HfGenerationConfig:
        """Build from a plain dict, reporting unknown keys together with bad values."""
        return validation.built(cls, options)
