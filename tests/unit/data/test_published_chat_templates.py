"""Observations render as the published chat templates of the major model families render
an observation turn (roles ``user`` and ``tool``), read from copies of the templates in
tests/fixtures/published_chat_templates (see its README). observations.json there holds,
for an observation after a plain assistant reply that did not end with EOS, the exact text
each template gives (the reply's closing, the observation turn, the next assistant prefix;
Llama 3.x and Cohere write tool results through ``tojson``, JSON-quoted), or the reason in
the ValueError when a template cannot render that role there. The tokenizer is a tiny one
with ChatML tokens (Mistral's and Llama 3's BOS and EOS where their templates write them).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import pytest

from envloop.data.chat_templates import ObservationRenderer, ToolsRequired
from envloop.models.tokenizers import apply_chat_template_settings
from tests.fixtures.chat_templates import build_chatml_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "published_chat_templates"
EXPECTED = json.loads((TEMPLATES / "observations.json").read_text(encoding="utf-8"))
OBSERVATION = EXPECTED["observation"]
RENDERED = [(n, role) for n, roles in EXPECTED["rendered"].items() for role in roles]
REFUSED = [(n, role) for n, roles in EXPECTED["refused"].items() for role in roles]
SPECIAL_TOKENS = {
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.3-70B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
}
"""BOS and EOS of the families whose templates write them around an observation."""
THINKING_OFF = " (thinking off)"
"""A name with this suffix renders its template with ``chat_template_kwargs``
``{enable_thinking: false}``."""


@functools.cache
def chatml_tokenizer():
    return build_chatml_tokenizer()


@functools.cache
def renderer(name: str) -> ObservationRenderer:
    template = name.removesuffix(THINKING_OFF)
    tokenizer = copy.deepcopy(chatml_tokenizer())
    if template in SPECIAL_TOKENS:
        bos, eos = SPECIAL_TOKENS[template]
        tokenizer.add_special_tokens({"bos_token": bos, "eos_token": eos})
    kwargs = {"enable_thinking": False} if name.endswith(THINKING_OFF) else None
    text = (TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")
    return ObservationRenderer(apply_chat_template_settings(tokenizer, text, kwargs))


@pytest.mark.parametrize(("name", "role"), RENDERED)
def test_an_observation_renders_as_the_published_template_renders_it(name, role):
    expected = EXPECTED["rendered"][name][role]
    assert renderer(name).render(role, OBSERVATION, response_ended_with_eos=False) == expected
    eos = renderer(name).eos_text  # a reply that ended with EOS is not closed twice
    assert renderer(name).render(role, OBSERVATION, True) == expected.removeprefix(eos)


@pytest.mark.parametrize(("name", "role"), REFUSED)
def test_a_role_the_template_cannot_render_is_refused_with_its_reason(name, role):
    reason = EXPECTED["refused"][name][role]
    error = ToolsRequired if "without tool definitions" in reason else ValueError
    with pytest.raises(error, match=re.escape(reason)):
        renderer(name).render(role, OBSERVATION, response_ended_with_eos=False)


def test_the_llama3_tool_result_is_found_although_written_as_json():
    text = renderer("meta-llama-Llama-3.1-8B-Instruct").render("tool", OBSERVATION, True)
    assert OBSERVATION not in text and json.dumps(OBSERVATION) in text


def test_every_family_is_covered_and_every_template_file_is_tested():
    files = {path.stem for path in TEMPLATES.glob("*.jinja")}
    names = {name.removesuffix(THINKING_OFF) for name, _ in RENDERED + REFUSED}
    assert names == files
    assert {(name, role) for name in names for role in ("user", "tool")} <= {
        (name.removesuffix(THINKING_OFF), role) for name, role in RENDERED + REFUSED
    }
    families = ["Qwen2.5", "Qwen3", "QwQ", "DeepSeek-R1", "DeepSeek-V3", "Llama-3", "gemma",
                "gpt-oss", "Mistral", "Phi", "granite", "GLM", "Kimi", "Cohere"]  # fmt: skip
    assert [f for f in families if not any(f in name for name in files)] == []
    thinking = [n for n in EXPECTED["rendered"] if n.endswith(THINKING_OFF)]
    assert sorted(thinking) == ["Qwen-Qwen3-0.6B (thinking off)", "Qwen3.5-4B (thinking off)"]
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    assert [f for f in sorted(files) if f"{f}.jinja" not in readme] == []
