"""Tokenizers configured as NeMo-RL's tokenizer config describes them.

:func:`get_tokenizer` loads a tokenizer by name (a local folder, a hub id ``org/name`` or
``bundled:<name>``), gives it a pad token (EOS when it has none), sets its chat template
(:func:`resolve_chat_template`) and makes ``chat_template_kwargs`` apply to every
``apply_chat_template`` call on it. :func:`apply_chat_template_settings` does the last two
to a tokenizer or a multimodal processor a backend loaded; the policy configs of both
backends declare the two settings with :data:`ChatTemplate` and :data:`ChatTemplateKwargs`.

``trust_remote_code`` is never passed: it would run Python code downloaded from the hub, in
this process and in every Ray actor the tokenizer is sent to. A tokenizer that needs it can
be loaded by the caller, after reviewing that code, and configured with
:func:`configure_tokenizer`.
"""

import functools
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from envloop.config import validation
from envloop.config.errors import ConfigError
from envloop.data.chat_templates import COMMON_CHAT_TEMPLATES
from envloop.models.bundled import BUNDLED_PREFIX, resolve_model
from envloop.models.tokenizer_classes import remember_class, remembered_class

__all__ = [
    "PASSTHROUGH_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateKwargs",
    "TokenizerConfig",
    "apply_chat_template_settings",
    "configure_tokenizer",
    "get_tokenizer",
    "resolve_chat_template",
]

PASSTHROUGH_TEMPLATE = COMMON_CHAT_TEMPLATES.passthrough_prompt_response
"""The template ``chat_template: None`` selects: the message contents, concatenated."""

_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


ChatTemplate = Annotated[
    str | None,
    Field(
        "default",
        description=(
            "the chat template prompts and observations render with: default (the "
            "tokenizer's own), null (the message contents concatenated), a .jinja file or "
            "the template text"
        ),
    ),
]
"""The ``chat_template`` setting (see :func:`resolve_chat_template`)."""

ChatTemplateKwargs = Annotated[
    dict[str, Any] | None,
    Field(
        None,
        description=(
            "extra variables of every chat-template rendering, e.g. {enable_thinking: false} "
            "for Qwen3-family models; null: none"
        ),
    ),
]
"""The ``chat_template_kwargs`` setting: defaults of every ``apply_chat_template`` call."""


class TokenizerConfig(TypedDict):
    name: Annotated[str, Field(description='a local folder, a hub id or "bundled:<name>"')]
    chat_template: NotRequired[ChatTemplate]
    chat_template_kwargs: NotRequired[ChatTemplateKwargs]


def resolve_chat_template(tokenizer_config: Any, own: str | None) -> str | None:
    """The chat template ``tokenizer_config`` selects, given the tokenizer's ``own``.

    ``chat_template`` absent or ``"default"`` (any case): ``own``; ``None``:
    :data:`PASSTHROUGH_TEMPLATE`; a string ending in ``.jinja``: that file's text
    (FileNotFoundError naming the path if it does not exist); any other string: itself.

    >>> resolve_chat_template({"name": "m"}, "T"), resolve_chat_template(
    ...     {"chat_template": "Default"}, "T"
    ... )
    ('T', 'T')
    >>> resolve_chat_template({"chat_template": None}, "T") == PASSTHROUGH_TEMPLATE
    True
    >>> resolve_chat_template({"chat_template": "{{ messages[0]['content'] }}"}, "T")
    "{{ messages[0]['content'] }}"
    """
    if "chat_template" not in tokenizer_config:
        return own
    template = tokenizer_config["chat_template"]
    if template is None:
        return PASSTHROUGH_TEMPLATE
    if template.lower() == "default":
        return own
    if template.endswith(".jinja"):
        return _read_template(template)
    return str(template)


def _read_template(path: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"chat_template {path!r}: no such .jinja file. Give an existing file, the template "
            "text itself, 'default' (the tokenizer's own) or null (contents concatenated)."
        )
    return Path(path).read_text(encoding="utf-8")


def get_tokenizer(
    tokenizer_config: TokenizerConfig | dict[str, Any], get_processor: bool = False
) -> Any:
    """The tokenizer ``tokenizer_config["name"]`` names, configured by
    :func:`configure_tokenizer` (NeMo-RL's ``algorithms.utils.get_tokenizer``).

    ``name`` is a local folder, a hub id (``org/name``; needs the hub or its local cache) or
    ``bundled:<name>`` (a bundled demo model, see :mod:`envloop.models.bundled`).
    ``trust_remote_code`` is not passed (see the module docstring). ``get_processor=True``
    (a vision-language processor) is not supported yet and raises ValueError. A config with
    unknown keys or wrong types raises :class:`~envloop.config.errors.ConfigError`; a name
    that cannot be loaded raises OSError naming it.
    """
    if get_processor:
        raise ValueError(
            "get_tokenizer(get_processor=True): vision-language processors are not supported "
            "by envloop yet. Load one with transformers.AutoProcessor.from_pretrained(name) "
            "and pass its .tokenizer to configure_tokenizer, or call get_tokenizer without "
            "get_processor for a text-only tokenizer."
        )
    problems = validation.config_problems(TokenizerConfig, tokenizer_config)
    if problems:
        raise ConfigError("TokenizerConfig", problems)
    tokenizer = _load_tokenizer(tokenizer_config["name"])
    return configure_tokenizer(tokenizer, tokenizer_config)


def configure_tokenizer(tokenizer: Any, tokenizer_config: TokenizerConfig | dict[str, Any]) -> Any:
    """``tokenizer`` (changed in place and returned) with a pad token (EOS when it has none),
    the chat template :func:`resolve_chat_template` selects, and ``chat_template_kwargs`` as
    defaults of every ``apply_chat_template`` call (an explicit argument still wins).

    The defaults are a :func:`functools.partial` of the bound method stored on the instance,
    as in NeMo-RL: the tokenizer still pickles (e.g. to a Ray actor) and keeps them.
    """
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return apply_chat_template_settings(
        tokenizer,
        tokenizer_config.get("chat_template", "default"),
        tokenizer_config.get("chat_template_kwargs"),
    )


def apply_chat_template_settings(
    tokenizer: Any, chat_template: str | None = "default", kwargs: dict[str, Any] | None = None
) -> Any:
    """``tokenizer`` (changed in place and returned) with the chat template
    ``chat_template`` selects (:func:`resolve_chat_template`: ``"default"`` keeps its own)
    and ``kwargs`` as defaults of every ``apply_chat_template`` call on it (an explicit
    argument still wins). A multimodal processor gets both, and so does its tokenizer, so
    that whatever renders with either renders alike.

    The defaults are a :func:`functools.partial` of the bound method stored on the instance,
    as in NeMo-RL: the tokenizer still pickles (e.g. to a Ray actor) and keeps them.
    """
    inner = getattr(tokenizer, "tokenizer", None)
    for target in (tokenizer, inner) if inner is not None else (tokenizer,):
        own = getattr(target, "chat_template", None)
        target.chat_template = resolve_chat_template({"chat_template": chat_template}, own)
        if kwargs:
            target.apply_chat_template = functools.partial(target.apply_chat_template, **kwargs)
    return tokenizer


def _load_tokenizer(name: str) -> Any:
    path = resolve_model(name)
    if not Path(path).is_dir() and not _HUB_ID.match(path):
        raise FileNotFoundError(
            f"Tokenizer {name!r}: no such folder. Give an existing folder, a hub id like "
            f"'org/name', or {BUNDLED_PREFIX}<name> for a bundled model."
        )
    try:
        return _from_pretrained(path)
    except (OSError, ValueError) as exc:
        where = "the folder" if Path(path).is_dir() else "the hub (or its local cache)"
        raise OSError(
            f"Tokenizer {name!r} could not be loaded from {where}: {str(exc).rstrip('. ')}. "
            "A folder must hold the tokenizer files (tokenizer.json or a vocabulary, "
            "tokenizer_config.json); a hub id looks like 'org/name' and needs network access "
            "or a cached copy."
        ) from exc


def _from_pretrained(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)``; a folder loaded before is loaded by the same
    class directly, without AutoTokenizer's torch import (see
    :mod:`envloop.models.tokenizer_classes`)."""
    folder = Path(path).is_dir()
    remembered: Any = remembered_class(path) if folder else None
    if remembered is not None:
        return remembered.from_pretrained(path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if folder:
        remember_class(path, type(tokenizer))
    return tokenizer
