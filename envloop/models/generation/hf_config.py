"""The settings of the transformers backend (:class:`HfGenerationConfig`), declared once and
validated on construction with every problem reported. Imports no torch: ``envloop run``
checks them before it starts anything, and its ``policy`` section is this config."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from envloop.config.validation import Config, NonEmptyStr
from envloop.distributed.ray_utils import check_placement
from envloop.models.generation.threads import DEFAULT_CPU_THREADS
from envloop.models.tokenizers import ChatTemplate, ChatTemplateKwargs

Device = Literal["cpu", "cuda", "auto"]
DType = Literal["float32", "bfloat16", "float16"]


class HfGenerationConfig(Config):
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

    model_name: NonEmptyStr
    """Local folder, hub id (e.g. ``Qwen/Qwen3-0.6B``) or ``bundled:policy`` (the tiny demo
    policy), loaded with ``AutoModelForCausalLM.from_pretrained``, or with
    ``AutoModelForImageTextToText`` and its processor when its config has a vision part."""
    tokenizer_name: NonEmptyStr | None = None
    """Tokenizer folder, hub id or ``bundled:<name>``; None: ``model_name``'s."""
    chat_template: ChatTemplate  # both declared in envloop.models.tokenizers
    chat_template_kwargs: ChatTemplateKwargs
    device: Device = "cpu"
    """``auto``: cuda when available, else cpu."""
    dtype: DType = "float32"
    """Weights dtype."""
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    """Sampling temperature: logits are divided by it before top-k/top-p filtering (for
    argmax, generate greedily)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass in (0, 1]; 1 keeps every token."""
    top_k: Annotated[int, Field(ge=1)] | None = None
    """Keep only the k most likely tokens; None: all."""
    max_new_tokens: Annotated[int, Field(ge=1)] = 512
    """Most tokens generated per sample and turn; a sample's remaining ``max_seq_len`` may
    lower it."""
    micro_batch_size: Annotated[int, Field(ge=1)] = 32
    """Rows decoded together in one forward pass (per worker)."""
    seed: Annotated[int, Field(ge=0)] = 0
    """Sampling seed; worker ``i`` uses ``seed + i``."""
    num_workers: Annotated[int, Field(ge=1)] = 1
    """1: generate in this process; N: N Ray actors, each with its own model copy."""
    worker_num_cpus: Annotated[float, Field(ge=0)] = 1.0
    """CPUs Ray reserves for each worker actor (``num_workers`` > 1 only)."""
    worker_num_gpus: Annotated[float, Field(ge=0)] = 0.0
    """GPUs Ray reserves for each worker actor; must be > 0 for cuda workers."""
    worker_placement: str = "default"
    """Nodes of a Ray cluster the worker actors go to (``num_workers`` > 1 only), as
    ``envs.<task>.placement`` says: ``default`` (Ray's DEFAULT strategy), ``spread`` (a soft
    node affinity to each node in turn) or ``resource:<name>`` (nodes holding that custom
    resource). A worker replacing a lost one is placed the same way."""
    worker_max_retries: Annotated[int, Field(ge=0)] = 2
    """Times a row is generated again after its worker actor was lost (its node died, its
    process was killed); a row whose worker is lost once more comes back with no tokens
    and the failure in ``generation_error``."""
    worker_startup_timeout_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 600.0
    """Longest wait for a worker actor to be placed, load its model (and a replacement the
    current weights) and serve; workers not serving by then fail the start (or count as
    lost once more)."""
    kv_cache_on_update: Literal["keep", "recompute"] = "keep"
    """After ``update_weights``, a running row's KV cache and next-token logits: ``keep`` the
    old weights', or ``recompute`` them by prefilling its sequence so far with the new ones."""
    cpu_threads: Annotated[int, Field(ge=1)] | None = DEFAULT_CPU_THREADS
    """torch threads of each process that generates on CPU (process-wide); None: one per
    core, slower when other processes share the cores. Ignored on cuda."""

    @field_validator("worker_placement")
    @classmethod
    def _known_placement(cls, placement: str) -> str:
        return check_placement(placement)

    @model_validator(mode="after")
    def _tokenizer_defaults_to_model(self) -> HfGenerationConfig:
        if self.tokenizer_name is None:
            object.__setattr__(self, "tokenizer_name", self.model_name)
        return self

    @model_validator(mode="after")
    def _workers_have_gpus(self) -> HfGenerationConfig:
        if self.num_workers > 1 and self.device in ("cuda", "auto") and not self.worker_num_gpus:
            raise ValueError(
                f"worker_num_gpus: 0 gives the {self.num_workers} workers no GPU for device="
                f"{self.device!r}; set it (e.g. 1) or use device='cpu'"
            )
        return self
