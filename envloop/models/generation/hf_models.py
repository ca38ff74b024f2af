"""Loading what :class:`~envloop.models.generation.hf_generation.HfGeneration` runs: the
model (a causal LM, or an image-text-to-text model when its config has a vision part), its
tokenizer and, for vision-language models, its processor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from envloop.models.bundled import resolve_model
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.processors import load_processor
from envloop.models.tokenizers import apply_chat_template_settings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Tokenizers:
    """The text tokenizer, and the processor of a vision-language model (else None)."""

    tokenizer: Any
    processor: Any


def is_vision_language(model_name: str) -> bool:
    """Whether the model's config has a vision part (``vision_config``), so it loads with
    ``AutoModelForImageTextToText`` and its inputs go through a processor."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model(model_name))
    return getattr(config, "vision_config", None) is not None


def load_tokenizers(config: HfGenerationConfig, vision_language: bool) -> Tokenizers:
    """The tokenizer of ``config.tokenizer_name`` and, for a vision-language model, the
    processor (loaded from the same folder or hub id; its tokenizer is the tokenizer), with
    ``config.chat_template`` and ``config.chat_template_kwargs``."""
    from transformers import AutoTokenizer

    assert config.tokenizer_name is not None  # HfGenerationConfig fills it in
    name = resolve_model(config.tokenizer_name)
    template = (config.chat_template, config.chat_template_kwargs)
    if not vision_language:
        tokenizer = AutoTokenizer.from_pretrained(name)
        return Tokenizers(apply_chat_template_settings(tokenizer, *template), None)
    try:
        processor = load_processor(name)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{config.model_name!r} is a vision-language model, so HfGeneration needs its "
            f"processor, but none loads from tokenizer_name {config.tokenizer_name!r} ({exc}). "
            "Point tokenizer_name at a folder or hub id with the model's processor files "
            "(preprocessor_config.json and the tokenizer)."
        ) from exc
    apply_chat_template_settings(processor, *template)  # and to its tokenizer
    return Tokenizers(processor.tokenizer, processor)


def load_model(config: HfGenerationConfig, device: torch.device, vision_language: bool) -> Any:
    """The model in eval mode on ``device``, in ``config.dtype``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model: Any = auto.from_pretrained(resolve_model(config.model_name), dtype=DTYPES[config.dtype])
    return model.to(device).eval()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "HfGenerationConfig.device='cuda' but no CUDA device is visible; "
            "use device='cpu' or 'auto'."
        )
    return torch.device(device)


def pad_token_id(tokenizer: Any, name: str | None) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer {name!r} has no pad token, which HfGeneration needs to pad outputs. "
            "Set one and save the tokenizer (tokenizer.pad_token = '<unused token>'; "
            "tokenizer.save_pretrained(folder)), then point tokenizer_name at that folder."
        )
    return int(tokenizer.pad_token_id)


def eos_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """Every EOS id named by the tokenizer, the model config and its generation config."""
    generation_config = getattr(model, "generation_config", None)
    sources = [
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
    ]
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("Neither the tokenizer nor the model config names an EOS token id.")
    return frozenset(ids)
