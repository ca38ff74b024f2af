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
    split_response_rows,
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


def one_row_outputs(output, widths):
    """``output``'s rows as one-row outputs, as ``generate_async`` hands them back: each
    only as wide as ``widths`` says (its own prompt and response)."""
    return [
        BatchedDataDict(
            {
                key: value[j : j + 1, :width] if value.dim() == 2 else value[j : j + 1]
                for key, value in output.items()
                if isinstance(value, torch.Tensor)
            },
            **(
                {"generation_error": [output["generation_error"][j]]}
                if "generation_error" in output
                else {}
            ),
        )
        for j, width in enumerate(widths)
    ]


def assert_same_responses(got, expected):
    for key in ("token_ids", "logprobs", "versions"):
        got_pieces, expected_pieces = getattr(got, key), getattr(expected, key)
        assert [p.tolist() for p in got_pieces] == [p.tolist() for p in expected_pieces], key
        assert [p.dtype for p in got_pieces] == [p.dtype for p in expected_pieces], key
    for key in ("counts", "flat_ids", "min_versions", "max_versions"):
        assert torch.equal(getattr(got, key), getattr(expected, key)), key
    assert got.texts == expected.texts and got.ended_with_eos == expected.ended_with_eos
    assert got.errors == expected.errors


def test_split_response_rows_equals_split_responses_of_their_batch(tiny_tokenizer, two_responses):
    output, input_lengths, hello, ok = two_responses
    third = generation_output([[1, 5, 6]], [ok], [-0.75], tiny_tokenizer.pad_token_id)
    output = BatchedDataDict.from_batches([output, third], {"output_ids": 0})
    output["policy_versions"] = torch.arange(output["output_ids"].numel(), dtype=torch.int32).view(
        output["output_ids"].shape
    )
    output["generation_error"] = [None, "server said no", None]
    input_lengths = torch.tensor([2, 1, 3])
    budgets = torch.tensor([4, 9, 2])  # row 0 cut before its EOS, row 2 after 2 tokens
    rows = one_row_outputs(output, [2 + len(hello) + 1, 1 + len(ok), 3 + len(ok)])
    got = split_response_rows(rows, input_lengths.tolist(), budgets.tolist(), tiny_tokenizer)
    expected = split_responses(output, input_lengths, budgets, tiny_tokenizer)
    assert_same_responses(got, expected)
    assert got.counts.tolist() == [4, 0, 2] and got.errors == [None, "server said no", None]
    assert got.min_versions.tolist()[1] == -1 and got.min_versions.tolist()[0] > 0


def test_split_response_rows_reads_version_zero_for_rows_without_versions(
    tiny_tokenizer, two_responses
):
    output = two_responses[0]
    rows = one_row_outputs(output, [output["output_ids"].shape[1]] * 2)
    rows[0]["policy_versions"] = torch.full(rows[0]["output_ids"].shape, 3, dtype=torch.int32)
    got = split_response_rows(rows, [2, 1], [99, 99], tiny_tokenizer)
    assert [v.tolist() for v in got.versions] == [[3] * 5, [0] * 3]
    assert got.min_versions.tolist() == [3, 0] and got.max_versions.tolist() == [3, 0]
    without = split_response_rows(rows[1:], [1], [99], tiny_tokenizer)
    assert without.versions[0].dtype == torch.int32 and without.max_versions.tolist() == [0]


def test_split_response_rows_reads_rows_numpy_cannot_view(tiny_tokenizer, two_responses):
    # bfloat16 logprobs, logprobs still in autograd, int32 token ids: the same responses,
    # with the engine's dtypes.
    output, input_lengths, _, _ = two_responses
    rows = one_row_outputs(output, [output["output_ids"].shape[1]] * 2)
    rows[0]["logprobs"] = rows[0]["logprobs"].to(torch.bfloat16)
    rows[1]["logprobs"] = rows[1]["logprobs"].clone().requires_grad_(True)
    rows[1]["output_ids"] = rows[1]["output_ids"].to(torch.int32)
    got = split_response_rows(rows, input_lengths.tolist(), [99, 99], tiny_tokenizer)
    expected_output = BatchedDataDict(output)
    expected_output["logprobs"] = torch.cat(
        [rows[0]["logprobs"].float(), rows[1]["logprobs"].detach()]
    )
    expected = split_responses(
        expected_output, input_lengths, torch.tensor([99, 99]), tiny_tokenizer
    )
    assert_same_responses(got, expected)
    assert got.logprobs[0].dtype == torch.float32 and got.token_ids[1].dtype == torch.int64


def test_split_response_rows_rejects_a_row_claiming_tokens_it_lacks(tiny_tokenizer, two_responses):
    output, _, _, _ = two_responses
    rows = one_row_outputs(output, [7, 3])  # row 1: a prompt of 1 token and only 2 generated
    with pytest.raises(ValueError, match="generation_lengths counts more tokens than"):
        split_response_rows(rows, [2, 1], [99, 99], tiny_tokenizer)


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
