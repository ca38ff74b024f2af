"""Judge prompt templates: Jinja, autoescape off (prompts are not HTML), strict undefined (a
name the template uses that the sample lacks fails that sample, naming it).

A template renders the judge's user message from these variables:

- ``conversation``: the sample's messages (``role`` and ``content``), last response included;
- ``question``: the text of the first user message ("" when there is none);
- ``response``: the text of the last assistant message (sample mode);
- ``responses``: the last assistant message of every member of the group (group mode);
- ``metadata``: the sample's metadata (a mapping; {} when it has none);
- ``reference``: ``metadata["reference"]``, else ``metadata["ground_truth"]``, else None;
- ``rubric``: ``metadata["rubric"]`` (e.g. a list of criteria), else None.

Built-in templates (:data:`BUILTIN_TEMPLATES`): ``reference_equivalence`` (is the reply's
final answer right, against the reference when there is one), ``rubric`` (a score from 0 to
10 against the rubric's items) and ``group_comparison`` (every reply to one question, one
verdict line ``<k>: <verdict>`` each). The bundled judge was trained on the first only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from envloop.environments.utils import content_text

__all__ = ["BUILTIN_TEMPLATES", "JudgeTemplate", "load_template", "template_variables"]

BUILTIN_TEMPLATES: dict[str, str] = {
    "reference_equivalence": (
        "Question: {{ question }}\n"
        "Reply: {{ response }}\n"
        "{% if reference is not none %}Reference answer: {{ reference }}\n{% endif %}"
        "Is the reply's final answer correct? Answer yes or no."
    ),
    "rubric": (
        "Question: {{ question }}\n"
        "Reply: {{ response }}\n"
        "{% if reference is not none %}Reference answer: {{ reference }}\n{% endif %}"
        "Rubric:\n{% for item in rubric %}- {{ item }}\n{% endfor %}"
        "Score the reply against the rubric from 0 to 10. End with 'Score: <number>'."
    ),
    "group_comparison": (
        "Question: {{ question }}\n"
        "{% if reference is not none %}Reference answer: {{ reference }}\n{% endif %}"
        "{% for reply in responses %}Reply {{ loop.index }}: {{ reply }}\n{% endfor %}"
        "Judge each reply's final answer. Write one line per reply: '<number>: yes' or "
        "'<number>: no'."
    ),
}
"""Built-in template name -> its Jinja source."""

_ENV = ImmutableSandboxedEnvironment(
    autoescape=False, undefined=jinja2.StrictUndefined, keep_trailing_newline=True
)


class JudgeTemplate:
    """A compiled judge prompt template; ``name`` says where it came from."""

    def __init__(self, source: str, name: str) -> None:
        try:
            self.template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(
                f"template {name}: line {exc.lineno}: {exc.message}; fix the template"
            ) from None
        self.name = name

    def render(self, variables: Mapping[str, Any]) -> str:
        """The judge's user message; ValueError naming the template and what failed (an
        undefined name, a type error inside the template)."""
        try:
            return self.template.render(**variables)
        except jinja2.UndefinedError as exc:
            raise ValueError(f"template {self.name}: {exc.message}") from None
        except Exception as exc:  # a filter or expression failing on this sample's data
            raise ValueError(f"template {self.name}: {type(exc).__name__}: {exc}") from None


def load_template(template: str) -> JudgeTemplate:
    """A built-in template by name, or the template in file ``template`` (a path with a
    ``.jinja``/``.j2``/``.txt`` suffix or any existing file). ValueError names the fix.

    >>> load_template("reference_equivalence").render({"question": "What is 1 + 1?",
    ...     "response": "2", "reference": None})
    "Question: What is 1 + 1?\\nReply: 2\\nIs the reply's final answer correct? Answer yes or no."
    """
    if template in BUILTIN_TEMPLATES:
        return JudgeTemplate(BUILTIN_TEMPLATES[template], repr(template))
    path = Path(template).expanduser()
    if path.is_file():
        return JudgeTemplate(path.read_text(encoding="utf-8"), str(path))
    raise ValueError(template_problem(template) or f"template {template!r}: cannot be read")


def template_problem(template: Any) -> str | None:
    """Why ``template`` names neither a built-in template nor a file (None when it does)."""
    if not isinstance(template, str) or not template:
        return f"template: expected a built-in name or a file path, got {template!r}"
    if template in BUILTIN_TEMPLATES or Path(template).expanduser().is_file():
        return None
    names = ", ".join(BUILTIN_TEMPLATES)
    return f"template: {template!r} is neither a built-in template ({names}) nor a file"


def template_variables(
    messages: list[Mapping[str, Any]], metadata: Any, responses: list[str] | None = None
) -> dict[str, Any]:
    """The variables a template is rendered with (see the module docstring) for one sample,
    or for a group (``responses``: each member's last assistant text).

    >>> v = template_variables([{"role": "user", "content": "Q"},
    ...                         {"role": "assistant", "content": "A"}], {"ground_truth": "4"})
    >>> v["question"], v["response"], v["reference"], v["rubric"]
    ('Q', 'A', '4', None)
    """
    md = dict(metadata) if isinstance(metadata, Mapping) else {}
    reference = md.get("reference", md.get("ground_truth"))
    conversation = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    return {
        "conversation": conversation,
        "question": _first(conversation, "user"),
        "response": _last(conversation, "assistant"),
        "responses": responses if responses is not None else [],
        "metadata": md,
        "reference": None if reference is None else str(reference),
        "rubric": md.get("rubric"),
    }


def _first(messages: list[dict[str, Any]], role: str) -> str:
    return next((_text(m) for m in messages if m["role"] == role), "")


def _last(messages: list[dict[str, Any]], role: str) -> str:
    return next((_text(m) for m in reversed(messages) if m["role"] == role), "")


def _text(message: dict[str, Any]) -> str:
    return content_text(message["content"])
