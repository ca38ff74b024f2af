"""get_tokenizer: loading by folder and bundled name, template modes, kwargs, pad token, errors."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.data.chat_templates import COMMON_CHAT_TEMPLATES, render_chat
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.demo import bundled_path
from envloop.models.tokenizers import (
    PASSTHROUGH_TEMPLATE,
    apply_chat_template_settings,
    get_tokenizer,
    resolve_chat_template,
)
from tests.fixtures.chat_templates import build_chatml_tokenizer, build_llama3_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 7?"},
]
CHATML = (
    "<|im_start|>system\nUse the calculator.<|im_end|>\n"
    "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n"
)
CUSTOM = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
THINKING = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ 'assistant: <think>\\n' if enable_thinking else 'assistant: <think></think>\\n' }}"
    "{% endif %}"
)
"""Branches on ``enable_thinking``, as the Qwen3 templates do."""


@pytest.fixture
def chatml_dir(tmp_path):
    """A saved tokenizer with the ChatML template, EOS ``<|im_end|>``, pad ``<|endoftext|>``."""
    build_chatml_tokenizer().save_pretrained(tmp_path / "chatml")
    return str(tmp_path / "chatml")


def render(tokenizer, **kwargs):
    return tokenizer.apply_chat_template(CONVERSATION, tokenize=False, **kwargs)


# --- chat template modes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "template", [{}, {"chat_template": "default"}, {"chat_template": "DEFAULT"}]
)
def test_absent_or_default_template_keeps_the_tokenizers_own(chatml_dir, template):
    assert render(get_tokenizer({"name": chatml_dir, **template})) == CHATML


def test_none_selects_the_passthrough_template(chatml_dir):
    tokenizer = get_tokenizer({"name": chatml_dir, "chat_template": None})
    assert tokenizer.chat_template == PASSTHROUGH_TEMPLATE
    assert tokenizer.chat_template == COMMON_CHAT_TEMPLATES.passthrough_prompt_response
    assert render(tokenizer) == "Use the calculator.What is 12 * 7?"


def test_a_template_string_is_used_as_is(chatml_dir):
    tokenizer = get_tokenizer({"name": chatml_dir, "chat_template": CUSTOM})
    assert render(tokenizer) == "[system] Use the calculator.\n[user] What is 12 * 7?\n"


def test_a_jinja_path_is_read_from_the_file(chatml_dir, tmp_path):
    (tmp_path / "t.jinja").write_text(CUSTOM, encoding="utf-8")
    tokenizer = get_tokenizer({"name": chatml_dir, "chat_template": str(tmp_path / "t.jinja")})
    assert tokenizer.chat_template == CUSTOM
    assert render(tokenizer) == "[system] Use the calculator.\n[user] What is 12 * 7?\n"


def test_a_missing_jinja_file_is_named_in_the_error(chatml_dir, tmp_path):
    missing = str(tmp_path / "missing.jinja")
    message = (
        f"chat_template {missing!r}: no such .jinja file. Give an existing file, the template "
        "text itself, 'default' (the tokenizer's own) or null (contents concatenated)."
    )
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        get_tokenizer({"name": chatml_dir, "chat_template": missing})


def test_resolve_chat_template_keeps_a_missing_own_template():
    assert resolve_chat_template({"name": "m"}, None) is None
    assert resolve_chat_template({"name": "m", "chat_template": None}, None) == (
        PASSTHROUGH_TEMPLATE
    )


# --- chat_template_kwargs -----------------------------------------------------------------


def thinking_tokenizer(chatml_dir, **kwargs):
    config = {"name": chatml_dir, "chat_template": THINKING, "chat_template_kwargs": kwargs}
    return get_tokenizer(config)


def test_chat_template_kwargs_apply_to_every_call(chatml_dir):
    prompt = "system: Use the calculator.\nuser: What is 12 * 7?\n"
    tokenizer = thinking_tokenizer(chatml_dir, enable_thinking=False)
    assert render(tokenizer, add_generation_prompt=True) == prompt + "assistant: <think></think>\n"
    # an explicit argument still wins
    assert render(tokenizer, add_generation_prompt=True, enable_thinking=True) == (
        prompt + "assistant: <think>\n"
    )
    thinking = thinking_tokenizer(chatml_dir, enable_thinking=True)
    assert render(thinking, add_generation_prompt=True) == prompt + "assistant: <think>\n"


def test_chat_template_kwargs_reach_render_chat_and_the_message_log(chatml_dir):
    tokenizer = thinking_tokenizer(chatml_dir, enable_thinking=False)
    text = render_chat(tokenizer, CONVERSATION, add_generation_prompt=True)
    assert text.endswith("assistant: <think></think>\n")
    log = get_formatted_message_log(CONVERSATION, tokenizer, add_generation_prompt=True)
    ids = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_with_kwargs_pickles_and_keeps_them(chatml_dir):
    tokenizer = thinking_tokenizer(chatml_dir, enable_thinking=False)
    restored = pickle.loads(pickle.dumps(tokenizer))
    assert render(restored, add_generation_prompt=True).endswith("assistant: <think></think>\n")
    # the defaults are bound to the restored tokenizer, not to a copy of the original
    assert restored.apply_chat_template.func.__self__ is restored
    assert restored.apply_chat_template.keywords == {"enable_thinking": False}


@pytest.mark.parametrize("kwargs", [{}, {"chat_template_kwargs": None}])
def test_no_kwargs_leave_apply_chat_template_alone(chatml_dir, kwargs):
    tokenizer = get_tokenizer({"name": chatml_dir, **kwargs})
    assert "apply_chat_template" not in vars(tokenizer)


# --- pad token, bundled models ------------------------------------------------------------


def test_pad_token_defaults_to_eos(tmp_path):
    tokenizer = build_llama3_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no_pad")
    loaded = get_tokenizer({"name": str(tmp_path / "no_pad")})
    assert (loaded.pad_token, loaded.pad_token_id) == ("<|eot_id|>", loaded.eos_token_id)


def test_an_existing_pad_token_is_kept(chatml_dir):
    assert get_tokenizer({"name": chatml_dir}).pad_token == "<|endoftext|>"


def test_bundled_names_load_the_bundled_models_tokenizer():
    tokenizer = get_tokenizer({"name": "bundled:policy"})
    folder = bundled_path("policy")
    assert tokenizer.name_or_path == str(folder)
    assert tokenizer.chat_template == (folder / "chat_template.jinja").read_text()
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_an_unknown_bundled_name_says_which_exist():
    with pytest.raises(ValueError, match=re.escape("No bundled model 'critic'; the bundled")):
        get_tokenizer({"name": "bundled:critic"})


# --- errors -------------------------------------------------------------------------------


def test_processors_are_refused_with_what_to_use_instead(chatml_dir):
    message = (
        "get_tokenizer(get_processor=True): vision-language processors are not supported "
        "by envloop yet. Load one with transformers.AutoProcessor.from_pretrained(name) "
        "and pass its .tokenizer to configure_tokenizer, or call get_tokenizer without "
        "get_processor for a text-only tokenizer."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        get_tokenizer({"name": chatml_dir}, get_processor=True)


@pytest.mark.parametrize("name", ["/no/such/folder", "models/org/name"])
def test_a_missing_folder_names_the_name_and_the_fix(name):
    message = (
        f"Tokenizer {name!r}: no such folder. Give an existing folder, a hub id like "
        "'org/name', or bundled:<name> for a bundled model."
    )
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        get_tokenizer({"name": name})


def test_a_folder_without_tokenizer_files_names_the_folder(tmp_path):
    with pytest.raises(OSError, match=re.escape(f"Tokenizer {str(tmp_path)!r} could not be")):
        get_tokenizer({"name": str(tmp_path)})


def test_config_problems_are_reported_together(chatml_dir):
    config = {"name": chatml_dir, "chat_template": 3, "chat_templat_kwargs": {}}
    with pytest.raises(ConfigError) as caught:
        get_tokenizer(config)
    assert caught.value.problems == [
        "chat_template: expected str | None, got int (3)",
        "chat_templat_kwargs: unknown option. Did you mean 'chat_template_kwargs'?",
    ]


# --- apply_chat_template_settings ---------------------------------------------------------

QWEN3_SWITCH = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""ChatML with Qwen3's switch: ``enable_thinking: false`` opens the reply with an empty
thinking block."""


def test_a_processor_and_its_tokenizer_both_take_the_settings():
    from envloop.models.tiny_vlm import build_tiny_vlm_processor

    processor = build_tiny_vlm_processor()
    own = processor.chat_template
    assert apply_chat_template_settings(processor) is processor  # "default": as they were
    assert processor.chat_template == own and "apply_chat_template" not in vars(processor)
    apply_chat_template_settings(processor, QWEN3_SWITCH, {"enable_thinking": False})
    user = "<|im_start|>user\nWhat is 12 * 7?<|im_end|>\n"
    expected = user + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for rendering in (processor, processor.tokenizer):
        assert render_chat(rendering, CONVERSATION[1:], add_generation_prompt=True) == expected
    apply_chat_template_settings(processor, None)
    assert processor.tokenizer.chat_template == PASSTHROUGH_TEMPLATE
