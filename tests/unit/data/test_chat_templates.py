"""Chat-template rendering, batch tokenization and observation rendering."""

from __future__ import annotations

import re

import pytest
import torch

from envloop.data.chat_templates import COMMON_CHAT_TEMPLATES, ObservationRenderer, render_chat
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.tokenization import tokenize_texts
from tests.fixtures.chat_templates import (
    CHATML_KNOWN_ROLES_TEMPLATE,
    CHATML_STRICT_ROLES_TEMPLATE,
    CHATML_TRIM_TEMPLATE,
    PLAIN_TEMPLATE,
    build_chatml_tokenizer,
    build_llama3_tokenizer,
    chat_template_ids,
)

PROMPT = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 12 * 7?"},
]


class Rollout:
    """Token ids as a rollout builds them: a templated prompt, then generated responses
    (tokenized content plus EOS when the response ended with EOS) and rendered observations,
    each appended without ever re-tokenizing what came before."""

    def __init__(self, tokenizer, prompt):
        self.tokenizer = tokenizer
        self.renderer = ObservationRenderer(tokenizer)
        self.conversation = list(prompt)
        log = get_formatted_message_log(prompt, tokenizer, add_generation_prompt=True)
        self.ids = torch.cat([m["token_ids"] for m in log]).tolist()
        self.ended_with_eos = True

    def respond(self, content, ended_with_eos):
        self.ids += tokenize_texts(self.tokenizer, [content])[0]
        if ended_with_eos:
            self.ids.append(self.tokenizer.eos_token_id)
        self.conversation.append({"role": "assistant", "content": content})
        self.ended_with_eos = ended_with_eos

    def observe(self, role, content):
        text = self.renderer.render(role, content, response_ended_with_eos=self.ended_with_eos)
        self.ids += tokenize_texts(self.tokenizer, [text])[0]
        self.conversation.append({"role": role, "content": content})
        return text


# --- render_chat --------------------------------------------------------------------------


def test_render_chat_without_a_chat_template_says_how_to_fix_it():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = None
    message = (
        f"Tokenizer {type(tokenizer).__name__} has no chat_template; set "
        "tokenizer.chat_template, or use observation_format='raw'."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        render_chat(tokenizer, PROMPT)


def test_a_template_that_needs_tool_definitions_says_so():
    # Iterates over `tools` unguarded: jinja's bare "'NoneType' object is not iterable"
    # becomes an error that names the cause, wherever the template renders.
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    user = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, user, tools=[{"name": "calc"}]) == "[calc]<user>hi"
    cause = "cannot render a conversation without tool definitions"
    with pytest.raises(ValueError, match=f"{cause}.*'NoneType' object is not iterable"):
        render_chat(tokenizer, user)
    with pytest.raises(ValueError, match=cause):
        get_formatted_message_log(user, tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    with pytest.raises(TypeError):  # any other TypeError is the template's own
        render_chat(tokenizer, user)


def test_render_chat_renders_role_and_content_only(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi", "token_ids": torch.tensor([5]), "x": None}]
    assert render_chat(tiny_tokenizer, messages) == "<|im_start|>user\nhi<|im_end|>\n"
    assert render_chat(tiny_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_render_chat_renders_the_llama3_template(llama3_tokenizer):
    assert render_chat(llama3_tokenizer, PROMPT[1:], add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12 * 7?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


# --- tokenize_texts -----------------------------------------------------------------------


def test_tokenize_texts_of_no_texts_is_empty(tiny_tokenizer):
    assert tokenize_texts(tiny_tokenizer, []) == []


def test_tokenize_texts_tokenizes_each_text_without_special_tokens(llama3_tokenizer):
    texts = ["What is 12 * 7?", "", "<|start_header_id|>user<|end_header_id|>\n\n84<|eot_id|>"]
    out = tokenize_texts(llama3_tokenizer, texts)
    # Plain tokenization of this tokenizer prepends BOS (as Llama 3 does); tokenize_texts
    # must not.
    assert llama3_tokenizer(texts[0])["input_ids"][0] == llama3_tokenizer.bos_token_id
    assert out == [llama3_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert out[1] == []
    header, end_header, eot = llama3_tokenizer.convert_tokens_to_ids(
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    assert out[2][0] == header
    assert out[2][2] == end_header
    assert out[2][-1] == eot
    assert [llama3_tokenizer.decode(ids) for ids in out] == texts


# --- ObservationRenderer: exact continuation of the templated conversation ----------------


@pytest.mark.parametrize(
    ("role", "content"),
    [
        ("user", "correct"),
        ("tool", "<result>84</result>"),
        ("environment", "  84\n"),
        ("user", ""),
    ],
)
def test_observation_after_an_eos_response_continues_the_template_exactly(
    chat_tokenizer, role, content
):
    rollout = Rollout(chat_tokenizer, PROMPT)
    rollout.respond("The answer is 84.", ended_with_eos=True)
    rollout.observe(role, content)
    assert rollout.ids == chat_template_ids(chat_tokenizer, rollout.conversation, True)


@pytest.mark.parametrize(
    ("role", "content"),
    [("tool", "<result>84</result>"), ("user", "  lower \n")],
)
def test_observation_after_a_stop_string_response_starts_with_the_assistant_closing(
    chat_tokenizer, role, content
):
    rollout = Rollout(chat_tokenizer, PROMPT)
    rollout.respond("Let me compute. <call>12 * 7</call>", ended_with_eos=False)
    text = rollout.observe(role, content)
    assert text.startswith(chat_tokenizer.eos_token)
    assert rollout.ids == chat_template_ids(chat_tokenizer, rollout.conversation, True)


def test_chatml_observation_texts(tiny_tokenizer):
    renderer = ObservationRenderer(tiny_tokenizer)
    assert renderer.render("tool", "<result>84</result>", response_ended_with_eos=True) == (
        "\n<|im_start|>tool\n<result>84</result><|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.render("tool", " 84 ", response_ended_with_eos=False) == (
        "<|im_end|>\n<|im_start|>tool\n 84 <|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_observation_texts(llama3_tokenizer):
    renderer = ObservationRenderer(llama3_tokenizer)
    turn = (
        "<|start_header_id|>user<|end_header_id|>\n\n84<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert renderer.render("user", "84", response_ended_with_eos=True) == turn
    assert renderer.render("user", "84", response_ended_with_eos=False) == "<|eot_id|>" + turn


def test_multi_turn_observations_stay_exact(chat_tokenizer):
    rollout = Rollout(chat_tokenizer, PROMPT)
    rollout.respond("<call>12 * 7</call>", ended_with_eos=False)
    rollout.observe("tool", "<result>84</result>")
    rollout.respond("<guess>84</guess>", ended_with_eos=True)
    rollout.observe("user", "correct")
    rollout.respond("The answer is 84.", ended_with_eos=True)
    rollout.observe("tool", "done\n")
    assert rollout.ids == chat_template_ids(chat_tokenizer, rollout.conversation, True)


def test_a_template_that_trims_content_is_still_exact():
    tokenizer = build_chatml_tokenizer(CHATML_TRIM_TEMPLATE)
    renderer = ObservationRenderer(tokenizer)
    assert renderer.render("user", "  84 \n", response_ended_with_eos=True) == (
        "\n<|im_start|>user\n84<|im_end|>\n<|im_start|>assistant\n"
    )
    # The same role again, content with and without whitespace to trim.
    assert renderer.render("user", "\tlower", response_ended_with_eos=False) == (
        "<|im_end|>\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    )
    for ended_with_eos in (True, False):
        rollout = Rollout(tokenizer, PROMPT)
        rollout.respond("<call>12 * 7</call>", ended_with_eos=ended_with_eos)
        rollout.observe("tool", "  <result>84</result>\n\n")
        rollout.respond("The answer is 84.", ended_with_eos=True)
        rollout.observe("user", " correct ")
        assert rollout.ids == chat_template_ids(tokenizer, rollout.conversation, True)


def test_a_template_that_skips_the_role_raises_instead_of_losing_the_observation():
    tokenizer = build_chatml_tokenizer(CHATML_KNOWN_ROLES_TEMPLATE)
    renderer = ObservationRenderer(tokenizer)
    message = (
        "The chat template drops messages with role 'environment', so the observation would "
        "vanish from the sequence. Return observations with a role the template renders"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        renderer.render("environment", "Environment: incorrect", response_ended_with_eos=True)
    assert renderer.render("tool", "84", response_ended_with_eos=False) == (
        "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_rejects_the_role_raises_a_clear_error():
    tokenizer = build_chatml_tokenizer(CHATML_STRICT_ROLES_TEMPLATE)
    renderer = ObservationRenderer(tokenizer)
    message = (
        "The chat template cannot render an observation with role 'tool' after an assistant "
        "turn (Unknown role: tool). Return observations with a role the template accepts"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        renderer.render("tool", "84", response_ended_with_eos=True)
    assert renderer.render("user", "84", response_ended_with_eos=True) == (
        "\n<|im_start|>user\n84<|im_end|>\n<|im_start|>assistant\n"
    )


def test_closing_that_does_not_start_with_eos_is_kept_whole():
    tokenizer = build_chatml_tokenizer(PLAIN_TEMPLATE)
    renderer = ObservationRenderer(tokenizer)
    for ended_with_eos in (True, False):
        assert renderer.render("user", "84", response_ended_with_eos=ended_with_eos) == (
            "\nuser: 84\nassistant:"
        )


def test_observation_renderer_without_a_chat_template_raises():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = None
    renderer = ObservationRenderer(tokenizer)
    with pytest.raises(ValueError, match="has no chat_template"):
        renderer.render("user", "84", response_ended_with_eos=True)


# --- COMMON_CHAT_TEMPLATES ------------------------------------------------------------------

PADDED = [
    {"role": "system", "content": "  Use the calculator.\n"},
    {"role": "user", "content": "What is 12 * 7? "},
    {"role": "assistant", "content": "84"},
]


def test_passthrough_template_concatenates_the_contents():
    tokenizer = build_chatml_tokenizer(COMMON_CHAT_TEMPLATES.passthrough_prompt_response)
    expected = "  Use the calculator.\nWhat is 12 * 7? 84"
    assert render_chat(tokenizer, PADDED) == expected
    assert render_chat(tokenizer, PADDED, add_generation_prompt=True) == expected


def test_simple_role_header_with_a_bos_token():
    tokenizer = build_llama3_tokenizer(COMMON_CHAT_TEMPLATES.simple_role_header)
    assert render_chat(tokenizer, PADDED[:2], add_generation_prompt=True) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nUse the calculator.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 * 7?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(tokenizer, PADDED[1:]) == (
        "<|begin_of_text|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 * 7?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n84<|eot_id|>"
    )


def test_simple_role_header_without_a_bos_token():
    tokenizer = build_chatml_tokenizer(COMMON_CHAT_TEMPLATES.simple_role_header)
    assert tokenizer.bos_token is None
    assert render_chat(tokenizer, PADDED[1:2]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 * 7?<|eot_id|>"
    )


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_get_formatted_message_log_is_token_exact_with_simple_role_header(add_generation_prompt):
    tokenizer = build_llama3_tokenizer(COMMON_CHAT_TEMPLATES.simple_role_header)
    log = get_formatted_message_log(PADDED, tokenizer, add_generation_prompt=add_generation_prompt)
    ids = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ids == chat_template_ids(tokenizer, PADDED, add_generation_prompt)
    assert ids.count(tokenizer.bos_token_id) == 1
    assert [m["content"] for m in log] == [m["content"] for m in PADDED]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_get_formatted_message_log_is_token_exact_with_passthrough(add_generation_prompt):
    tokenizer = build_chatml_tokenizer(COMMON_CHAT_TEMPLATES.passthrough_prompt_response)
    log = get_formatted_message_log(
        PADDED, tokenizer, add_eos_token=False, add_generation_prompt=add_generation_prompt
    )
    ids = torch.cat([m["token_ids"] for m in log]).tolist()
    assert ids == chat_template_ids(tokenizer, PADDED, add_generation_prompt)
    assert [tokenizer.decode(m["token_ids"]) for m in log] == [m["content"] for m in PADDED]
