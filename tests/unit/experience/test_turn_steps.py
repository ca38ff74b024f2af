"""Per-sample pieces of a turn: cutting responses out of generation output, assistant
messages, observation text and fitting, owned splits."""

from __future__ import annotations

import pytest
import torch

from envloop.data.chat_templates import ObservationRenderer
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.turn_steps import (
    assistant_message,
    check_generation_output,
    fit_observation,
    observation_text,
    split_owned,
    split_responses,
)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generation_output(prompts, responses, logprobs, pad_id) -> BatchedDataDict:
    """A GenerationOutputSpec batch: prompt + response per row, right-padded with ``pad_id``;
    each response token's logprob is its row's entry of ``logprobs``, 0 elsewhere."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    output_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    lp = torch.zeros((len(prompts), width), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        output_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        lp[i, len(p) : len(p) + len(r)] = logprobs[i]
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=lp,
        generation_lengths=torch.tensor([len(r) for r in responses]),
    )


@pytest.fixture
def two_responses(tiny_tokenizer):
    """Row 0: prompt of 2 tokens, "hello" + EOS. Row 1: prompt of 1 token, "ok!" (a stop
    string ended it: no EOS)."""
    eos = tiny_tokenizer.eos_token_id
    hello, ok = encode(tiny_tokenizer, "hello"), encode(tiny_tokenizer, "ok!")
    output = generation_output(
        [[1, 5], [1]], [[*hello, eos], ok], [-0.5, -0.25], tiny_tokenizer.pad_token_id
    )
    return output, torch.tensor([2, 1]), hello, ok


def test_split_responses_cuts_each_rows_generated_tokens(tiny_tokenizer, two_responses):
    output, input_lengths, hello, ok = two_responses
    eos = tiny_tokenizer.eos_token_id
    responses = split_responses(output, input_lengths, None, tiny_tokenizer)
    assert [t.tolist() for t in responses.token_ids] == [[*hello, eos], ok]
    assert [t.dtype for t in responses.token_ids] == [torch.long, torch.long]
    assert [lp.tolist() for lp in responses.logprobs] == [[-0.5] * 5, [-0.25] * 3]
    assert responses.counts.tolist() == [5, 3]
    assert responses.flat_ids.tolist() == [*hello, eos, *ok]


def test_split_responses_drops_a_final_eos_from_the_text_only(tiny_tokenizer, two_responses):
    output, input_lengths, _, _ = two_responses
    responses = split_responses(output, input_lengths, None, tiny_tokenizer)
    assert responses.texts == ["hello", "ok!"]
    assert responses.ended_with_eos == [True, False]


def test_split_responses_cuts_a_response_longer_than_its_budget(tiny_tokenizer, two_responses):
    output, input_lengths, hello, ok = two_responses
    responses = split_responses(output, input_lengths, torch.tensor([4, 2]), tiny_tokenizer)
    assert [t.tolist() for t in responses.token_ids] == [hello, ok[:2]]
    assert responses.counts.tolist() == [4, 2]
    assert responses.texts == ["hello", "ok"]
    assert responses.ended_with_eos == [False, False]  # the budget cut the EOS off


def test_split_responses_of_an_empty_batch(tiny_tokenizer):
    output = BatchedDataDict(
        output_ids=torch.zeros((0, 0), dtype=torch.long),
        logprobs=torch.zeros((0, 0)),
        generation_lengths=torch.zeros(0, dtype=torch.long),
    )
    responses = split_responses(output, torch.zeros(0, dtype=torch.long), None, tiny_tokenizer)
    assert responses.token_ids == [] and responses.texts == [] and responses.ended_with_eos == []
    assert responses.counts.tolist() == [] and responses.flat_ids.tolist() == []


def test_an_empty_response_has_no_tokens_and_no_eos(tiny_tokenizer):
    output = generation_output([[1, 5]], [[]], [0.0], tiny_tokenizer.pad_token_id)
    responses = split_responses(output, torch.tensor([2]), None, tiny_tokenizer)
    assert [t.tolist() for t in responses.token_ids] == [[]]
    assert responses.texts == [""] and responses.ended_with_eos == [False]


def test_check_generation_output_names_the_missing_keys(two_responses):
    output = BatchedDataDict(output_ids=two_responses[0]["output_ids"])
    with pytest.raises(ValueError) as info:
        check_generation_output(output, 2)
    assert str(info.value) == (
        "The policy's generate() output lacks ['generation_lengths', 'logprobs'] "
        "(GenerationOutputSpec)."
    )


def test_check_generation_output_wants_one_row_per_prompt(two_responses):
    check_generation_output(two_responses[0], 2)
    with pytest.raises(ValueError) as info:
        check_generation_output(two_responses[0], 3)
    assert str(info.value) == (
        "The policy's generate() returned 2 rows of 'output_ids' for 3 prompts; it must "
        "return one row per prompt, in input order."
    )


def test_assistant_message_keeps_tokens_and_logprobs():
    ids, lp = torch.tensor([4, 5]), torch.tensor([-0.5, -1.0])
    message = assistant_message("hi", ids, lp)
    assert list(message) == ["role", "content", "token_ids", "generation_logprobs"]
    assert message["role"] == "assistant" and message["content"] == "hi"
    assert message["token_ids"] is ids and message["generation_logprobs"] is lp
    assert list(assistant_message("hi", ids, None)) == ["role", "content", "token_ids"]


def test_raw_observation_text_is_the_content_as_is():
    observation = {"role": "tool", "content": " <result>84</result>\n"}
    assert observation_text(observation, None, ended_with_eos=True) == " <result>84</result>\n"


def test_chatml_observation_text_continues_the_conversation(tiny_tokenizer):
    renderer = ObservationRenderer(tiny_tokenizer)
    observation = {"role": "user", "content": "again"}
    turn = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert observation_text(observation, renderer, ended_with_eos=True) == "\n" + turn
    assert observation_text(observation, renderer, ended_with_eos=False) == "<|im_end|>\n" + turn


def test_llama3_observation_text_continues_the_conversation(llama3_tokenizer):
    renderer = ObservationRenderer(llama3_tokenizer)
    observation = {"role": "user", "content": "again"}
    turn = (
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert observation_text(observation, renderer, ended_with_eos=True) == turn
    assert observation_text(observation, renderer, ended_with_eos=False) == "<|eot_id|>" + turn


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (5, ([1, 2, 3], False)),  # ends at 8 of 10
        (7, ([1, 2, 3], True)),  # reaches max_seq_len exactly
        (8, ([1, 2], True)),  # cut to fit
        (10, ([], True)),  # nothing fits
    ],
)
def test_fit_observation(length, expected):
    assert fit_observation([1, 2, 3], length, max_seq_len=10) == expected


def test_an_empty_observation_truncates_only_a_full_sequence():
    assert fit_observation([], 9, max_seq_len=10) == ([], False)
    assert fit_observation([], 10, max_seq_len=10) == ([], True)


def test_split_owned_pieces_have_their_own_storage():
    flat = torch.arange(6)
    pieces = split_owned(flat, [2, 0, 4])
    assert [p.tolist() for p in pieces] == [[0, 1], [], [2, 3, 4, 5]]
    for piece in pieces:
        assert piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()
    pieces[0][0] = 99
    assert flat[0].item() == 0
