"""Load a reward model and its tokenizer as a validated reward-model config describes.

The tokenizer config is NeMo-RL's (``name``, absent: ``model_name``; ``chat_template``;
``chat_template_kwargs``), loaded by :func:`envloop.models.tokenizers.get_tokenizer`, which
documents the template modes.
"""

from __future__ import annotations

from typing import Any

import torch

from envloop.models.bundled import resolve_model
from envloop.models.tokenizers import get_tokenizer


def tokenizer_options(config: Any) -> dict[str, Any]:
    """The config's ``tokenizer`` as a dict with ``name`` set.

    >>> tokenizer_options({"tokenizer": None, "model_name": "m"})
    {'name': 'm'}
    >>> tokenizer_options({"tokenizer": {"chat_template": None}, "model_name": "m"})
    {'chat_template': None, 'name': 'm'}
    """
    tok = config["tokenizer"]
    options = dict(tok) if isinstance(tok, dict) else {"name": tok} if tok else {}
    return {**options, "name": options.get("name") or config["model_name"]}


def load_reward_model(config: Any, device: str) -> tuple[Any, Any]:
    """``(tokenizer, model)`` via ``from_pretrained`` (hub id or folder), template set,
    checkpoint applied, ``config.pad_token_id`` set (the model uses it to find each row's
    last real token)."""
    from transformers import AutoModelForSequenceClassification

    options = tokenizer_options(config)
    tokenizer = get_tokenizer(options)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"reward_model: tokenizer {options['name']!r} has no chat template; set the "
            "config's 'tokenizer' to one that has the reward model's template, or give "
            "tokenizer.chat_template."
        )
    model: Any = AutoModelForSequenceClassification.from_pretrained(
        resolve_model(config["model_name"]), num_labels=1, dtype=getattr(torch, config["precision"])
    )
    if config["checkpoint_path"]:
        model.load_state_dict(_load_state_dict(config["checkpoint_path"]))
    text_config = model.config.get_text_config()
    if getattr(text_config, "pad_token_id", None) is None:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        text_config.pad_token_id = model.config.pad_token_id = tokenizer.pad_token_id
    if text_config.pad_token_id is None:
        raise ValueError(f"reward_model: {options['name']!r} has neither a pad nor an EOS token.")
    return tokenizer, model.to(device).eval()


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
