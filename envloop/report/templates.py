r"""The report's jinja2 templates (``envloop/report/assets/*.j2``) and how they are rendered.

Autoescaping is on for every template, so each value a template prints is HTML-escaped by
jinja2; Python code hands templates plain text and numbers, never markup. ``StrictUndefined``
makes a variable a template uses but was not given an error instead of an empty string.
``tojson`` writes the page's JSON data block: no ``<``, ``>``, ``&`` or ``'`` survives
literally (jinja2 writes ``\u003c`` and so on), and NaN or an infinity is an error.

>>> render_string("<p>{{ text }}</p>", text="<b>R&D</b>")
'<p>&lt;b&gt;R&amp;D&lt;/b&gt;</p>'
>>> render_string("{{ data | tojson }}", data=["</script>", "R&D"])
'["\\u003c/script\\u003e", "R\\u0026D"]'
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jinja2


@cache
def environment() -> jinja2.Environment:
    """The environment of the report's templates, loaded from the package's assets folder."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("envloop.report", "assets"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.policies["json.dumps_kwargs"] = {"sort_keys": False, "ensure_ascii": False,
                                         "allow_nan": False, "default": str}  # fmt: skip
    return env


def render(name: str, **context: Any) -> str:
    """The template ``name`` (a file of ``envloop/report/assets``) rendered with ``context``."""
    return environment().get_template(name).render(**context)


def render_string(source: str, **context: Any) -> str:
    """A template given as text, rendered with the report's environment (same escaping)."""
    return environment().from_string(source).render(**context)
