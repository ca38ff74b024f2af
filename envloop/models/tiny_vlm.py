"""A tiny vision-language model built locally from a config, with no downloads.

For tests, demos and benchmarks: a Qwen2.5-VL model (2 vision blocks of width 32, 2 text
layers of width 64, random weights) and its processor (the Pillow image processor, a byte-
level BPE trained in milliseconds with the Qwen-VL special tokens, and a ChatML template
that renders image parts as ``<|vision_start|><|image_pad|><|vision_end|>``). Images are
resized to between 4 and 64 patches of 14x14 pixels (1 to 16 placeholder tokens).
``save_tiny_vlm`` writes both to a folder, so the code that uses them goes through the real
loading path (``load_processor`` and ``AutoModelForImageTextToText.from_pretrained``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from envloop.models.processors import processor_build
from envloop.models.tiny import TRAINING_CORPUS, train_chatml_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

VL_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML whose image parts render as one Qwen-VL placeholder each (the processor expands it)."""

PATCH = 14
MIN_PIXELS = PATCH * PATCH * 4
MAX_PIXELS = PATCH * PATCH * 64


def build_tiny_vlm_processor(
    texts: list[str] | None = None, vocab_size: int = 400, digits_apart: bool = False
) -> Any:
    """A Qwen2.5-VL processor with a tiny BPE tokenizer trained on ``texts`` (a small
    built-in corpus by default); no video processor unless torchvision is installed."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    tokenizer = train_chatml_tokenizer(texts or TRAINING_CORPUS * 4, vocab_size, digits_apart)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHATML_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor_class, video = processor_build(Qwen2_5_VLProcessor, _video_processor)
    return processor_class(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=VL_CHATML_TEMPLATE,
        **video,
    )  # fmt: skip


def _video_processor() -> Any:
    """The tiny processor's video processor (built only where torchvision is installed)."""
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(patch_size=PATCH, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def tiny_vlm_config(processor: Any, hidden_size: int = 64, layers: int = 2) -> Any:
    """A Qwen2.5-VL config sized for CPU tests, with ``processor``'s token ids."""
    from transformers import Qwen2_5_VLConfig

    tokenizer = processor.tokenizer
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    heads = max(2, hidden_size // 16)
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": 2048,
            "rope_scaling": {
                "type": "mrope",
                "mrope_section": _mrope_section(hidden_size // heads),
            },
            "tie_word_embeddings": True,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [1],
            "window_size": 56,
            "patch_size": PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_tiny_vlm(processor: Any, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> Any:
    """A Qwen2.5-VL model for ``processor`` with random weights (deterministic in ``seed``)."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model: Any = AutoModelForImageTextToText.from_config(
        tiny_vlm_config(processor, hidden_size, layers)
    )
    with torch.no_grad():  # peaked next-token distributions, as in tiny.build_tiny_model
        model.get_input_embeddings().weight.mul_(5.0)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model.eval()


def save_tiny_vlm(folder: Path, seed: int = 0) -> Path:
    """Save a tiny VLM and its processor to ``folder``; returns ``folder``."""
    processor = build_tiny_vlm_processor()
    build_tiny_vlm(processor, seed).save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _mrope_section(head_dim: int) -> list[int]:
    """Rotary frequencies (head_dim / 2 of them) split over time, height and width."""
    half = head_dim // 2
    t = half - 2 * (half * 3 // 8)
    return [t, half * 3 // 8, half * 3 // 8]
