"""The report's jinja2 environment: autoescaping, strict undefined variables, safe JSON."""

from __future__ import annotations

import json
import math

import jinja2
import pytest

from envloop.report.page import Tile
from envloop.report.templates import environment, render_string

EVIL = "<script>alert(1)</script>{{ x }}</script>&amp;"


def test_every_printed_value_is_escaped_once():
    html = render_string('<p title="{{ text }}">{{ text }}</p>', text=EVIL + "\"'")
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;{{ x }}&lt;/script&gt;&amp;amp;&#34;&#39;"
    assert html == f'<p title="{escaped}">{escaped}</p>'


def test_a_value_is_never_rendered_as_a_template():
    assert render_string("{{ text }}", text="{{ 7 * 7 }}{% if 1 %}x{% endif %}") == (
        "{{ 7 * 7 }}{% if 1 %}x{% endif %}"
    )


def test_missing_variables_and_attributes_are_errors():
    with pytest.raises(jinja2.UndefinedError, match="'nothing' is undefined"):
        render_string("{{ nothing }}")
    with pytest.raises(jinja2.UndefinedError, match="has no attribute 'colour'"):
        render_string("{{ tile.colour }}", tile=Tile("1", "math", "mean reward", "#000000"))
    with pytest.raises(jinja2.UndefinedError):
        render_string("{% if flag %}x{% endif %}")


def test_tojson_escapes_markup_characters_and_keeps_key_order():
    text = render_string("{{ data | tojson }}", data={"z": "</script>&'", "a": "é", "n": None})
    assert text == '{"z": "\\u003c/script\\u003e\\u0026\\u0027", "a": "é", "n": null}'
    assert list(json.loads(text)) == ["z", "a", "n"]
    with pytest.raises(ValueError, match="not JSON compliant"):
        render_string("{{ data | tojson }}", data=[math.nan])


def test_autoescape_is_on_for_every_template_name():
    env = environment()
    assert env.autoescape is True and env.undefined is jinja2.StrictUndefined
    assert set(env.list_templates()) >= {
        "report.html.j2", "sections.html.j2", "histogram.svg.j2", "report.css", "report.js"
    }  # fmt: skip
