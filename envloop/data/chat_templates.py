"""Chat-template rendering shared by the message utilities and the rollout engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from envloop.data.content_parts import content_text_parts


class COMMON_CHAT_TEMPLATES:  # NeMo-RL's name, kept so ported code runs unchanged
    """Chat templates (Jinja, as in a ``tokenizer_config.json``) that NeMo-RL configs name.

    ``passthrough_prompt_response``: the message contents concatenated, no role markers and
    no special tokens (what ``chat_template: null`` selects in a tokenizer config).
    ``simple_role_header``: each message as a Llama-3-style header
    ``<|start_header_id|>{role}<|end_header_id|>\\n\\n``, its content with surrounding
    whitespace trimmed, then ``<|eot_id|>``; the tokenizer's BOS token (if it has one) before
    the first message, and the assistant header after the last with
    ``add_generation_prompt``.

    >>> from jinja2 import Template
    >>> messages = [{"role": "user", "content": " 2+2? "}, {"role": "assistant", "content": "4"}]
    >>> Template(COMMON_CHAT_TEMPLATES.passthrough_prompt_response).render(messages=messages)
    ' 2+2? 4'
    >>> text = Template(COMMON_CHAT_TEMPLATES.simple_role_header).render(
    ...     messages=messages[:1], bos_token="<s>", add_generation_prompt=True
    ... )
    >>> for part in text.split("<|eot_id|>"):
    ...     print(repr(part))
    '<s><|start_header_id|>user<|end_header_id|>\\n\\n2+2?'
    '<|start_header_id|>assistant<|end_header_id|>\\n\\n'
    """

    passthrough_prompt_response = (
        "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    )
    simple_role_header = (
        "{% for message in messages %}"
        "{% if loop.first and bos_token %}{{ bos_token }}{% endif %}"
        "{{ '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' }}"
        "{{ message['content'] | trim }}"
        "{{ '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}"
    )


class ToolsRequired(ValueError):
    """A chat template that cannot render a conversation given no tool definitions (it
    iterates over ``tools`` without checking that any were given)."""


_USER_MARK = "\x00envloop-user\x00"
_ASSISTANT_MARK = "\x00envloop-assistant\x00"
_SLOT = "\x00envloop-slot\x00"
_PROBE = "  probe\ncontent  "


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The tokenizer's chat template applied to ``messages`` (role and content only), as
    text; ``tools`` (function definitions) go to the template when given."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"Tokenizer {type(tokenizer).__name__} has no chat_template; set "
            "tokenizer.chat_template, or use observation_format='raw'."
        )
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    extra = {} if tools is None else {"tools": tools}
    try:
        return tokenizer.apply_chat_template(
            plain, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    except TypeError as exc:
        if tools is None and _renders_with_tools(tokenizer, plain, add_generation_prompt):
            raise ToolsRequired(
                f"The chat template of {type(tokenizer).__name__} cannot render a conversation "
                f"without tool definitions: it iterates over `tools` without checking that "
                f"any were given ({exc}). Give the conversation its tools, or use a template "
                "that guards them ({% if tools %}...{% endif %})."
            ) from exc
        raise


def _renders_with_tools(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> bool:
    """Whether the template renders ``messages`` once given an empty list of tools."""
    try:
        tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=[]
        )
    except Exception:
        return False
    return True


class ObservationRenderer:
    """Renders an environment observation as the chat template would continue a conversation.

    For a conversation ending in a generated assistant response, the text that follows it in
    the template's rendering of ``conversation + [observation]`` with the generation prompt:
    the assistant's closing (unless the response already ended with EOS), the observation
    turn, and the next assistant prefix. Templates that only wrap content are rendered once
    per role and reused (checked on a probe); others are rendered per observation.

    >>> from types import SimpleNamespace
    >>> class Tok(SimpleNamespace):
    ...     chat_template = "x"
    ...     eos_token = "<e>"
    ...     def apply_chat_template(self, messages, tokenize, add_generation_prompt):
    ...         text = "".join(f"<{m['role']}>{m['content']}<e>" for m in messages)
    ...         return text + ("<assistant>" if add_generation_prompt else "")
    >>> r = ObservationRenderer(Tok())
    >>> r.render("user", "4", response_ended_with_eos=True)
    '<user>4<e><assistant>'
    >>> r.render("user", "4", response_ended_with_eos=False)
    '<e><user>4<e><assistant>'
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # a tokenizer, or a multimodal processor
        self.eos_text: str = getattr(tokenizer, "tokenizer", tokenizer).eos_token or ""
        self._slots: dict[str, tuple[str, str] | None] = {}

    def render(self, role: str, content: Any, response_ended_with_eos: bool) -> str:
        """The observation's text, starting right after the assistant response. ``content``
        is a string, or a list of parts (rendered by the template each time)."""
        if isinstance(content, str):
            slot = self._slots[role] if role in self._slots else self._learn_slot(role)
            text = slot[0] + content + slot[1] if slot else None
        else:
            slot = text = None
        if text is None:
            text = self._render_after_response(role, content)
        if response_ended_with_eos and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text) :]
        return text

    def _learn_slot(self, role: str) -> tuple[str, str] | None:
        head, sep, tail = self._render_after_response(role, _SLOT).partition(_SLOT)
        slot = (head, tail) if sep else None
        probe_ok = slot and self._render_after_response(role, _PROBE) == head + _PROBE + tail
        self._slots[role] = slot if probe_ok else None
        return self._slots[role]

    def _render_after_response(self, role: str, content: Any) -> str:
        conversation = [
            {"role": "user", "content": _USER_MARK},
            {"role": "assistant", "content": _ASSISTANT_MARK},
            {"role": role, "content": content},
        ]
        try:
            text = render_chat(self.tokenizer, conversation, add_generation_prompt=True)
        except ToolsRequired as exc:
            raise ToolsRequired(
                f"{exc} Observations render without tool definitions: set "
                "policy.chat_template to a template that guards them, or use "
                "observation_format='raw'."
            ) from exc
        except Exception as exc:
            raise ValueError(
                f"The chat template cannot render an observation with role {role!r} after an "
                f"assistant turn ({exc}). Return observations with a role the template accepts "
                "(often 'user' or 'tool'), or use observation_format='raw'."
            ) from exc
        _, found, after = text.partition(_ASSISTANT_MARK)
        if not found:
            raise ValueError("The chat template dropped the assistant message's content.")
        if not _shows(content_text_parts(content).strip(), after):  # Qwen skips unknown roles
            raise ValueError(
                f"The chat template drops messages with role {role!r}, so the observation "
                "would vanish from the sequence. Return observations with a role the template "
                "renders (often 'user' or 'tool'; the math environment's is set by its "
                "observation_role), or use observation_format='raw'."
            )
        return after


def _shows(text: str, rendered: str) -> bool:
    """Whether ``text`` appears in ``rendered`` as is, or JSON-escaped as a template writes it
    through ``tojson`` (Llama 3.x and Cohere render tool results so: ``"a \\"b\\""``).

    >>> _shows('a "b"', '<|python_tag|>"a \\"b\\""<|eot_id|>'), _shows("a", "<|eot_id|>")
    (True, False)
    """
    escaped = (json.dumps(text, ensure_ascii=as_ascii)[1:-1] for as_ascii in (False, True))
    return text in rendered or any(form in rendered for form in escaped)
