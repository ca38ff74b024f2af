"""Load a reward model and its tokenizer as a validated reward-model config describes.

The tokenizer follows NeMo-RL's tokenizer config: ``name`` (absent: ``model_name``);
``chat_template`` absent or ``"default"`` keeps the tokenizer's own template, ``None``
concatenates the message contents, a path ending in ``.jinja`` is read from that file and
any other string is the template itself; ``chat_template_kwargs`` go to every
``apply_chat_template`` call (e.g. ``{"enable_thinking": False}``).
"""

from __future__ import annotations

from typing import Any

import torch

from envloop.demo import resolve_model
from envloop.environments.reward_model_checks import PRECISIONS

PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The template ``chat_template: null`` selects: the message contents, concatenated."""


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


def chat_template(options: dict[str, Any], own: str | None) -> str | None:
    """The template to use, given the tokenizer ``options`` and the tokenizer's ``own``.

    >>> chat_template({"name": "m"}, "T"), chat_template({"chat_template": "default"}, "T")
    ('T', 'T')
    >>> chat_template({"chat_template": None}, "T") == PASSTHROUGH_TEMPLATE
    True
    """
    if "chat_template" not in options or options["chat_template"] == "default":
        return own
    template = options["chat_template"]
    if template is None:
        return PASSTHROUGH_TEMPLATE
    if template.endswith(".jinja"):
        with open(template, encoding="utf-8") as file:
            return file.read()
    return template


def load_reward_model(config: Any, device: str) -> tuple[Any, Any]:
    """``(tokenizer, model)`` via ``from_pretrained`` (hub id or folder), template set,
    checkpoint applied, ``config.pad_token_id`` set (the model uses it to find each row's
    last real token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    options = tokenizer_options(config)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(options["name"]))
    tokenizer.chat_template = chat_template(options, tokenizer.chat_template)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"reward_model: tokenizer {options['name']!r} has no chat template; set the "
            "config's 'tokenizer' to one that has the reward model's template, or give "
            "tokenizer.chat_template."
        )
    model: Any = AutoModelForSequenceClassification.from_pretrained(
        resolve_model(config["model_name"]), num_labels=1, dtype=PRECISIONS[config["precision"]]
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
