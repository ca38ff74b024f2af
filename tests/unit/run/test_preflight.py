"""``envloop run`` renders prompts and observations with the policy's ``chat_template`` and
``chat_template_kwargs``, and its length check counts the prompts as rendered; on the
bundled policy's real tokenizer with a template that branches on ``enable_thinking`` as
Qwen3's does."""

from __future__ import annotations

import json

import pytest
import yaml

from envloop.config.errors import ConfigError
from envloop.data.chat_templates import ObservationRenderer
from envloop.run.config import load_run_config
from envloop.run.preflight import prepare_inputs
from envloop.run.runner import engine_tokenizer, make_policy

THINKING_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""ChatML (the bundled policy's own template) with Qwen3's switch: ``enable_thinking: false``
opens the reply with an empty thinking block."""
NO_THINKING = "<think>\n\n</think>\n\n"
PROMPTS = ["What is 2 + 3?", "What is 7 * 6?"]


@pytest.fixture
def run_yaml(tmp_path):
    """A run config next to its data and its template file (both named relative to it)."""
    rows = [{"task": "math", "prompt": p, "ground_truth": "5"} for p in PROMPTS]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "thinking.jinja").write_text(THINKING_CHATML)

    def write(**policy):
        config = {
            "policy": {"model_name": "bundled:policy", **policy},
            "data": {"path": "prompts.jsonl"},
            "envs": {"math": {"name": "math"}},
            "rollout": {"max_seq_len": 256},
        }
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
        return tmp_path / "run.yaml"

    return write


def prompt_texts(inputs) -> list[str]:
    ids = [[t for message in sample for t in message] for sample in inputs.token_ids]
    return [inputs.tokenizer.decode(sample) for sample in ids]


def chatml_prompt(prompt: str, thinking: bool) -> str:
    opening = "" if thinking else NO_THINKING
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{opening}"


def test_prompts_render_with_the_policy_chat_template_and_kwargs(run_yaml, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path.parent)  # the template file is found next to the config
    off = {"chat_template": "thinking.jinja", "chat_template_kwargs": {"enable_thinking": False}}
    inputs = prepare_inputs(load_run_config(run_yaml(**off)))
    assert prompt_texts(inputs) == [chatml_prompt(p, thinking=False) for p in PROMPTS]
    on = {"chat_template": THINKING_CHATML, "chat_template_kwargs": {"enable_thinking": True}}
    inputs = prepare_inputs(load_run_config(run_yaml(**on)))
    assert prompt_texts(inputs) == [chatml_prompt(p, thinking=True) for p in PROMPTS]
    inputs = prepare_inputs(load_run_config(run_yaml()))  # the tokenizer's own, no kwargs
    assert prompt_texts(inputs) == [chatml_prompt(p, thinking=True) for p in PROMPTS]


def test_the_length_check_counts_the_prompts_as_the_template_renders_them(run_yaml):
    thinking = {"chat_template": THINKING_CHATML, "chat_template_kwargs": {"enable_thinking": True}}
    inputs = prepare_inputs(load_run_config(run_yaml(**thinking)))
    longest = max(sum(map(len, sample)) for sample in inputs.token_ids)
    overrides = [f"rollout.max_seq_len={longest}"]
    prepare_inputs(load_run_config(run_yaml(**thinking), overrides))  # they fit
    overrides.append("policy.chat_template_kwargs.enable_thinking=false")
    config = load_run_config(run_yaml(**thinking), overrides)
    with pytest.raises(ConfigError, match=rf"rollout.max_seq_len: {longest} is smaller than 2"):
        prepare_inputs(config)


def test_observations_render_with_the_policy_chat_template_and_kwargs(run_yaml):
    settings = {
        "chat_template": THINKING_CHATML,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    policy = make_policy(load_run_config(run_yaml(**settings)).policy)
    try:
        renderer = ObservationRenderer(engine_tokenizer(policy))
        for role in ("user", "tool"):
            assert renderer.render(role, "Try again.", response_ended_with_eos=True) == (
                f"\n<|im_start|>{role}\nTry again.<|im_end|>\n<|im_start|>assistant\n{NO_THINKING}"
            )
    finally:
        policy.shutdown()


def test_a_missing_template_file_is_named_before_anything_loads(run_yaml):
    with pytest.raises(ConfigError) as info:
        load_run_config(run_yaml(chat_template="missing.jinja"))
    assert info.value.problems == [
        "policy.chat_template: no such .jinja file: 'missing.jinja' (relative paths are looked "
        "up in the current directory, then next to the config file). Give an existing file, "
        "the template text, default (the tokenizer's own) or null (the message contents "
        "concatenated)."
    ]
