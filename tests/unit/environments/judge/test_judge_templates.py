"""Judge prompt templates: built-ins render exactly, a template file, strict undefined names
and broken templates fail with the template named."""

from __future__ import annotations

import pytest

from envloop.environments.judge.templates import load_template, template_variables

LOG = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "\\boxed{4}"},
]


def test_reference_equivalence_with_and_without_reference():
    template = load_template("reference_equivalence")
    with_ref = template.render(template_variables(LOG, {"ground_truth": 4}))
    assert with_ref == (
        "Question: What is 2 + 2?\nReply: \\boxed{4}\nReference answer: 4\n"
        "Is the reply's final answer correct? Answer yes or no."
    )
    without = template.render(template_variables(LOG, None))
    assert "Reference" not in without


def test_rubric_and_group_templates():
    rubric = load_template("rubric").render(
        template_variables(LOG, {"rubric": ["shows work", "is right"], "reference": "4"})
    )
    assert "Reference answer: 4\nRubric:\n- shows work\n- is right\n" in rubric
    group = load_template("group_comparison").render(template_variables(LOG, {}, ["4", "5"]))
    assert "Reply 1: 4\nReply 2: 5\n" in group


def test_file_template_sees_conversation_and_metadata(tmp_path):
    path = tmp_path / "judge.jinja"
    path.write_text(
        "{% for m in conversation %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "<b>{{ metadata.topic }}</b>"
    )
    text = load_template(str(path)).render(template_variables(LOG, {"topic": "sums"}))
    assert text.endswith("[assistant] \\boxed{4}\n<b>sums</b>")  # no HTML escaping


def test_undefined_name_fails_naming_template_and_name(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ metadata.topic }}")
    with pytest.raises(ValueError, match=r"template .*t\.jinja: 'dict object' has no attribute"):
        load_template(str(path)).render(template_variables(LOG, {}))
    with pytest.raises(ValueError, match="'None' has no attribute|not iterable"):
        load_template("rubric").render(template_variables(LOG, {}))  # no rubric


def test_broken_and_unknown_templates(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("{% if %}")
    with pytest.raises(ValueError, match=r"bad\.jinja: line 1: .*; fix the template"):
        load_template(str(path))
    with pytest.raises(ValueError, match="'rubrik' is neither a built-in template"):
        load_template("rubrik")
