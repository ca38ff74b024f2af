from __future__ import annotations

import torch

from envloop.agents.sessions import Session
from envloop.data.llm_message_utils import get_formatted_message_log


def sampled(ids, logprob=-0.5):
    ids = torch.tensor(ids, dtype=torch.long)
    return {
        "role": "assistant",
        "content": "",
        "token_ids": ids,
        "generation_logprobs": torch.full((len(ids),), logprob),
    }


def test_an_extension_appends_only_the_new_messages(llama3_tokenizer):
    tok = llama3_tokenizer
    session = Session("s", "")
    messages = [{"role": "user", "content": "2 + 3?"}]
    plan = session.plan(tok, messages, None)
    prompt = get_formatted_message_log(messages, tok, add_generation_prompt=True)
    assert plan.prompt_ids == torch.cat([m["token_ids"] for m in prompt]).tolist()
    answer = [*tok.encode("5", add_special_tokens=False), tok.eos_token_id]
    session.record(plan, sampled(answer), {"role": "assistant", "content": "5"}, eos=True)
    messages += [{"role": "assistant", "content": " 5 "}, {"role": "user", "content": "Sure?"}]
    second = session.plan(tok, messages, None)
    turn = "<|start_header_id|>user<|end_header_id|>\n\nSure?<|eot_id|>"
    turn += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert second.segment is session.segments[0]
    assert second.prompt_ids == plan.prompt_ids + answer + tok.encode(
        turn, add_special_tokens=False
    )
    assert [m["role"] for m, _ in second.context] == ["user"]


def test_a_response_without_eos_is_closed_by_the_template(tiny_tokenizer):
    tok = tiny_tokenizer
    session = Session("s", "")
    plan = session.plan(tok, [{"role": "user", "content": "go"}], None)
    cut = tok.encode("<call>1</call>")
    session.record(plan, sampled(cut), {"role": "assistant", "content": "<call>1"}, eos=False)
    again = session.plan(tok, [{"role": "user", "content": "go"},
                               {"role": "assistant", "content": "<call>1"}], None)  # fmt: skip
    closing = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert again.context[0][0] == {"role": "context", "content": ""}
    assert again.prompt_ids == plan.prompt_ids + cut + closing


def test_what_counts_as_a_rewrite(tiny_tokenizer):
    tok = tiny_tokenizer
    session = Session("s", "")
    messages = [{"role": "user", "content": "go"}]
    plan = session.plan(tok, messages, None)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    session.record(plan, sampled(tok.encode("x")), reply, eos=False)
    spaced = {"name": "f", "arguments": '{ "a" : 1 }'}
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "id": "x", "function": spaced}],
    }
    tool = {"role": "tool", "tool_call_id": "c", "content": "1"}
    assert session.plan(tok, [*messages, echoed, tool], None).segment is not None
    changed = {**echoed, "tool_calls": [{**call, "function": {"name": "f", "arguments": "{}"}}]}
    rewrite = session.plan(tok, [*messages, changed, tool], None)
    assert rewrite.segment is None
    assert (
        rewrite.reason == "rewrite: messages[1] (assistant) differs from what the conversation held"
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert session.plan(tok, [*messages, echoed, tool], tools).reason == (
        "rewrite: the tool definitions changed"
    )
    assert session.plan(tok, messages, None).reason.startswith("rewrite: 1 messages, fewer")
