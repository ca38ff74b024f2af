"""Message utilities (docs/contract.md, "Message utilities"): flatten, pad, mask and
chat-template message logs."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from envloop.data.chat_templates import render_chat
from envloop.data.interfaces import TaskDataSpec
from envloop.data.llm_message_utils import (
    add_loss_mask_to_message_log,
    batched_message_log_to_flat_message,
    get_first_index_that_differs,
    get_formatted_message_log,
    get_keys_from_message_log,
    message_log_to_flat_messages,
    require_token_ids,
)
from envloop.distributed.batched_data_dict import BatchedDataDict
from tests.fixtures.chat_templates import (
    CHATML_STRIP_THINKING_TEMPLATE,
    LLAMA3_NO_BOS_TEMPLATE,
    PLAIN_TEMPLATE,
    build_chatml_tokenizer,
    build_llama3_tokenizer,
    chat_template_ids,
)


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def _message(role: str, ids: list[int], **extra) -> dict:
    return {"role": role, "content": f"{role}{len(ids)}", "token_ids": _ids(*ids), **extra}


def _concat_ids(log: list[dict]) -> list[int]:
    return torch.cat([m["token_ids"] for m in log]).tolist()


# --- get_keys_from_message_log ------------------------------------------------------------


def test_get_keys_from_message_log_keeps_only_the_keys_asked_for():
    ids = _ids(1, 2)
    log = [
        {"role": "user", "content": "hi", "token_ids": ids, "x": 1},
        {"role": "assistant", "content": "yo"},
    ]
    out = get_keys_from_message_log(log, ["role", "token_ids"])
    assert out == [{"role": "user", "token_ids": ids}, {"role": "assistant"}]
    assert out[0]["token_ids"] is ids
    assert list(log[0]) == ["role", "content", "token_ids", "x"]
    assert get_keys_from_message_log(log, iter(["content"])) == [
        {"content": "hi"},
        {"content": "yo"},
    ]
    assert get_keys_from_message_log([], ["role"]) == []


# --- message_log_to_flat_messages ---------------------------------------------------------


def test_flat_messages_concatenate_tensors_and_list_other_values():
    log = [
        _message("system", [1]),
        _message("user", [2, 3]),
        _message("assistant", [4, 5, 6], generation_logprobs=torch.tensor([-0.5, -1.0, -1.5])),
    ]
    flat = message_log_to_flat_messages(log)
    assert list(flat) == ["token_ids", "generation_logprobs", "role", "content"]
    assert flat["token_ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert flat["token_ids"].dtype == torch.int64
    assert flat["generation_logprobs"].tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -1.5]
    assert flat["generation_logprobs"].dtype == torch.float32
    assert flat["role"] == ["system", "user", "assistant"]
    assert flat["content"] == ["system1", "user2", "assistant3"]


def test_flat_messages_zero_fill_per_token_keys_a_message_lacks():
    log = [
        _message("assistant", [1, 2], token_loss_mask=torch.tensor([True, True])),
        _message("user", [3, 4, 5]),
        _message("assistant", [6], token_loss_mask=torch.tensor([True])),
    ]
    flat = message_log_to_flat_messages(log)
    assert flat["token_loss_mask"].tolist() == [True, True, False, False, False, True]
    assert flat["token_loss_mask"].dtype == torch.bool
    assert len(flat["token_loss_mask"]) == len(flat["token_ids"])


def test_flat_messages_of_an_empty_log_is_empty():
    assert message_log_to_flat_messages([]) == {}


# --- batched_message_log_to_flat_message --------------------------------------------------


def _two_logs() -> list[list[dict]]:
    return [
        [
            _message("user", [1, 2, 3]),
            _message("assistant", [4, 5], generation_logprobs=torch.tensor([-0.25, -0.5])),
        ],
        [_message("user", [7])],
    ]


def test_batched_flat_message_right_pads_each_key_with_its_pad_value():
    flat, lengths = batched_message_log_to_flat_message(
        _two_logs(), pad_value_dict={"token_ids": 99, "generation_logprobs": -9.0}
    )
    assert type(flat) is BatchedDataDict
    assert flat["token_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 99, 99, 99, 99]]
    assert flat["token_ids"].dtype == torch.int64
    # Prompt tokens, which have no logprobs, hold zeros (aligned with token_ids) and the
    # positions past a sample's tokens the pad value; a sample with no logprobs at all gets
    # an all-pad row.
    assert flat["generation_logprobs"].tolist() == [
        [0.0, 0.0, 0.0, -0.25, -0.5],
        [-9.0, -9.0, -9.0, -9.0, -9.0],
    ]
    assert flat["role"] == [["user", "assistant"], ["user"]]
    assert flat["content"] == [["user3", "assistant2"], ["user1"]]
    assert lengths.dtype == torch.int32
    assert lengths.tolist() == [5, 1]
    assert flat.size == 2


def test_batched_flat_message_keeps_every_tensor_key_as_wide_as_token_ids():
    # The only sample with logprobs is the shorter one: logprobs must still be [B, L].
    logs = [
        [
            _message("user", [1]),
            _message("assistant", [2], generation_logprobs=torch.tensor([-1.0])),
        ],
        [_message("user", [3, 4, 5, 6])],
    ]
    flat, lengths = batched_message_log_to_flat_message(
        logs, pad_value_dict={"generation_logprobs": -5.0}, make_sequence_length_divisible_by=3
    )
    assert flat["token_ids"].tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0]]
    assert flat["generation_logprobs"].tolist() == [
        [0.0, -1.0, -5.0, -5.0, -5.0, -5.0],
        [-5.0, -5.0, -5.0, -5.0, -5.0, -5.0],
    ]
    assert lengths.tolist() == [2, 4]


def test_batched_flat_message_pads_with_zero_by_default():
    flat, _ = batched_message_log_to_flat_message(_two_logs())
    assert flat["token_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 0, 0, 0, 0]]


@pytest.mark.parametrize(("divisor", "width"), [(1, 5), (2, 6), (4, 8), (5, 5), (8, 8)])
def test_batched_flat_message_rounds_the_length_up_to_the_divisor(divisor, width):
    flat, lengths = batched_message_log_to_flat_message(
        _two_logs(), pad_value_dict={"token_ids": -1}, make_sequence_length_divisible_by=divisor
    )
    assert flat["token_ids"].shape == (2, width)
    assert flat["generation_logprobs"].shape == (2, width)
    assert flat["token_ids"][0].tolist() == [1, 2, 3, 4, 5] + [-1] * (width - 5)
    assert lengths.tolist() == [5, 1]


def test_batched_flat_message_rejects_a_divisor_below_one():
    with pytest.raises(ValueError, match="make_sequence_length_divisible_by must be >= 1, got 0"):
        batched_message_log_to_flat_message(_two_logs(), make_sequence_length_divisible_by=0)


def test_batched_flat_message_of_an_empty_batch_is_empty():
    flat, lengths = batched_message_log_to_flat_message([], make_sequence_length_divisible_by=8)
    assert type(flat) is BatchedDataDict
    assert flat == {}
    assert lengths.dtype == torch.int32
    assert lengths.shape == (0,)


def test_batched_flat_message_needs_no_token_ids():
    # The flattener pads whatever tensors the messages hold; a message without token_ids
    # adds nothing to the keys it lacks. (The rollout engine checks its own input with
    # require_token_ids.)
    logs = _two_logs()
    logs[1].append({"role": "assistant", "content": "untokenized"})
    flat, lengths = batched_message_log_to_flat_message(logs)
    assert flat["token_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 0, 0, 0, 0]]
    assert flat["role"] == [["user", "assistant"], ["user", "assistant"]]
    assert lengths.tolist() == [5, 1]


def test_require_token_ids_names_the_sample_and_message_missing_token_ids():
    log = [_message("user", [7]), {"role": "assistant", "content": "untokenized"}]
    with pytest.raises(
        ValueError, match=re.escape("sample 1, message 1 (role 'assistant') has no 'token_ids'")
    ):
        require_token_ids(log, sample_index=1)


@pytest.mark.parametrize(
    ("token_ids", "described"),
    [
        (torch.tensor([1.0, 2.0]), "a (2,) torch.float32 tensor"),
        (torch.tensor([1, 2], dtype=torch.int32), "a (2,) torch.int32 tensor"),
        (torch.tensor([[1, 2]]), "a (1, 2) torch.int64 tensor"),
        ([1, 2], "list"),
    ],
)
def test_require_token_ids_rejects_token_ids_that_are_not_1d_int64(token_ids, described):
    log = [{"role": "user", "content": "x", "token_ids": token_ids}]
    message = f"sample 0, message 0: 'token_ids' must be a 1-D int64 tensor, got {described}."
    with pytest.raises(ValueError, match=re.escape(message)):
        require_token_ids(log, sample_index=0)


def test_require_token_ids_without_a_sample_index():
    with pytest.raises(ValueError, match=r"^message 0 \(role 'user'\) has no 'token_ids'"):
        require_token_ids([{"role": "user", "content": "x"}])
    require_token_ids([_message("user", [1])])


@st.composite
def message_logs(draw) -> list[dict]:
    """A log of 1-4 messages; assistant messages carry generation_logprobs."""
    log = []
    for _ in range(draw(st.integers(1, 4))):
        role = draw(st.sampled_from(["system", "user", "assistant", "tool"]))
        ids = draw(st.lists(st.integers(0, 50_000), max_size=6))
        message = _message(role, ids)
        if role == "assistant":
            logprobs = [-(i + 1) / 8 for i in range(len(ids))]
            message["generation_logprobs"] = torch.tensor(logprobs, dtype=torch.float32)
        log.append(message)
    return log


@settings(max_examples=80, deadline=None)
@given(
    logs=st.lists(message_logs(), min_size=1, max_size=5),
    divisor=st.integers(1, 8),
    pad=st.integers(-3, 3),
)
def test_padding_never_changes_unpadded_content(logs, divisor, pad):
    flat, lengths = batched_message_log_to_flat_message(
        logs,
        pad_value_dict={"token_ids": pad, "generation_logprobs": float(pad)},
        make_sequence_length_divisible_by=divisor,
    )
    expected_lengths = [sum(len(m["token_ids"]) for m in log) for log in logs]
    assert lengths.tolist() == expected_lengths
    width = flat["token_ids"].shape[1]
    assert width % divisor == 0
    assert width - divisor < max(expected_lengths) <= width
    has_logprobs = any("generation_logprobs" in m for log in logs for m in log)
    assert ("generation_logprobs" in flat) == has_logprobs
    for i, (log, n) in enumerate(zip(logs, expected_lengths)):
        assert flat["token_ids"][i, :n].tolist() == _concat_ids(log)
        assert flat["token_ids"][i, n:].tolist() == [pad] * (width - n)
        assert flat["role"][i] == [m["role"] for m in log]
        if has_logprobs and not any("generation_logprobs" in m for m in log):
            assert flat["generation_logprobs"][i].tolist() == [float(pad)] * width
        elif has_logprobs:
            logprobs = [
                lp
                for m in log
                for lp in m.get("generation_logprobs", torch.zeros(len(m["token_ids"]))).tolist()
            ]
            assert flat["generation_logprobs"].shape == flat["token_ids"].shape
            row = flat["generation_logprobs"][i].tolist()
            assert row[:n] == logprobs
            assert row[n:] == [float(pad)] * (width - n)


def test_batched_flat_message_pads_per_token_2d_tensors_along_the_sequence():
    def topk(start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + 2 * n, dtype=torch.int32).reshape(n, 2)

    logs = [
        [_message("user", [1, 2], top=topk(0, 2)), _message("assistant", [3], top=topk(10, 1))],
        [_message("user", [4], top=topk(20, 1))],
        [_message("user", [5])],
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, {"top": -1}, 2)
    assert flat["top"].dtype == torch.int32
    assert flat["top"].tolist() == [
        [[0, 1], [2, 3], [10, 11], [-1, -1]],
        [[20, 21], [-1, -1], [-1, -1], [-1, -1]],
        [[-1, -1]] * 4,  # a sample without the key: an all-pad row
    ]
    assert lengths.tolist() == [3, 1, 1]


def test_batched_flat_message_lengths_are_each_samples_longest_tensor():
    logs = [
        [{"input_ids": torch.tensor([1, 2]), "mask": torch.tensor([1, 1, 1])}],
        [{"input_ids": torch.tensor([3])}],
    ]
    flat, lengths = batched_message_log_to_flat_message(logs)
    assert lengths.tolist() == [3, 1]
    assert flat["input_ids"].tolist() == [[1, 2, 0], [3, 0, 0]]
    assert flat["mask"].tolist() == [[1, 1, 1], [0, 0, 0]]


def test_batched_flat_message_without_tensors_keeps_each_samples_first_value():
    flat, lengths = batched_message_log_to_flat_message(
        [[{"text": "a"}, {"text": "b"}], [{"other": 1}]]
    )
    assert flat == {"text": ["a", None], "other": [None, 1]}
    assert lengths.numel() == 0


def test_batched_flat_message_lists_are_empty_for_samples_without_the_key():
    logs = [[_message("user", [1], note="n")], [_message("user", [2])]]
    flat, _ = batched_message_log_to_flat_message(logs)
    assert flat["note"] == [["n"], []]


@pytest.mark.parametrize(
    ("logs", "message"),
    [
        (
            [[{"x": torch.tensor([1])}], [{"x": torch.tensor([1.0])}]],
            r"expected consistent types but got: \[torch.int64, torch.float32\] for key='x'",
        ),
        (
            [[{"x": torch.tensor([1])}, {"x": torch.tensor([1.0])}]],
            "expected consistent types .* in one message log",
        ),
        (
            [[{"x": torch.tensor([1])}], [{"x": torch.tensor([1], device="meta")}]],
            "expected tensors on the same device .* Move them to one device",
        ),
        (
            [[{"x": torch.tensor([[1]])}, {"x": torch.tensor([1])}]],
            "tensors for key='x' must have same number of dimensions",
        ),
        (
            [[{"x": torch.zeros(1, 2)}], [{"x": torch.zeros(1, 3)}]],
            "tensors for key='x' must have the same shape after dim 0",
        ),
        ([[{"x": torch.tensor(1)}]], "tensors for key='x' must be at least 1-D"),
        (
            [[{"x": torch.tensor([1])}, {"x": torch.tensor(2)}]],
            "tensors for key='x' must be at least 1-D",
        ),
        (
            [[{"x": torch.tensor([1])}], [{"x": [1]}]],
            "key='x' holds a tensor in some samples and another type in others",
        ),
    ],
    ids=["dtype", "dtype-in-log", "device", "rank", "trailing", "0-d", "0-d-later", "mixed"],
)
def test_batched_flat_message_rejects_inconsistent_tensors_naming_the_key(logs, message):
    with pytest.raises(RuntimeError, match=message):
        batched_message_log_to_flat_message(logs)


# --- add_loss_mask_to_message_log ---------------------------------------------------------


def _conversations() -> list[list[dict]]:
    return [
        [
            _message("system", [1]),
            _message("user", [2, 3]),
            _message("assistant", [4, 5]),
            _message("tool", [6]),
            _message("assistant", [7, 8, 9]),
        ],
        [_message("user", [1, 2]), _message("assistant", [3]), _message("user", [4])],
    ]


def _masks(logs: list[list[dict]]) -> list[list[list[bool]]]:
    return [[m["token_loss_mask"].tolist() for m in log] for log in logs]


def test_loss_mask_trains_on_assistant_messages_by_default():
    logs = _conversations()
    assert add_loss_mask_to_message_log(logs) is None
    assert _masks(logs) == [
        [[False], [False, False], [True, True], [False], [True, True, True]],
        [[False, False], [True], [False]],
    ]
    assert all(m["token_loss_mask"].dtype == torch.bool for log in logs for m in log)


def test_loss_mask_trains_on_the_roles_asked_for():
    logs = _conversations()
    add_loss_mask_to_message_log(logs, roles_to_train_on=["assistant", "tool"])
    assert _masks(logs) == [
        [[False], [False, False], [True, True], [True], [True, True, True]],
        [[False, False], [True], [False]],
    ]


def test_loss_mask_only_unmask_final_trains_on_the_last_message_if_its_role_matches():
    logs = _conversations()
    add_loss_mask_to_message_log(logs, only_unmask_final=True)
    assert _masks(logs) == [
        [[False], [False, False], [False, False], [False], [True, True, True]],
        [[False, False], [False], [False]],
    ]


def test_loss_mask_with_no_roles_masks_everything():
    logs = _conversations()
    add_loss_mask_to_message_log(logs, roles_to_train_on=())
    assert _masks(logs) == [
        [[False], [False, False], [False, False], [False], [False, False, False]],
        [[False, False], [False], [False]],
    ]


# --- get_formatted_message_log ------------------------------------------------------------


CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2 + 3?"}],
    "system-user": [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2 + 3?"},
    ],
    "multi-turn": [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": "<call>12 * 7</call>"},
        {"role": "tool", "content": "<result>84</result>"},
        {"role": "assistant", "content": "The answer is 84."},
        {"role": "user", "content": "Guess the number between 1 and 100."},
    ],
    "ends-with-assistant": [
        {"role": "user", "content": "Guess the number"},
        {"role": "assistant", "content": "<guess>50</guess>"},
    ],
    "whitespace": [
        {"role": "user", "content": "  leading and trailing  \n"},
        {"role": "assistant", "content": "\n\nx = ( 1 + 2 )\n"},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_formatted_token_ids_concatenate_to_the_whole_templated_conversation(
    chat_tokenizer, name, add_generation_prompt
):
    conversation = CONVERSATIONS[name]
    log = get_formatted_message_log(
        conversation, chat_tokenizer, add_generation_prompt=add_generation_prompt
    )
    assert _concat_ids(log) == chat_template_ids(
        chat_tokenizer, conversation, add_generation_prompt
    )
    assert "".join(chat_tokenizer.decode(m["token_ids"]) for m in log) == render_chat(
        chat_tokenizer, conversation, add_generation_prompt=add_generation_prompt
    )
    assert [m["role"] for m in log] == [m["role"] for m in conversation]
    # content stays the message's own text: environments see plain role/content messages
    assert [m["content"] for m in log] == [m["content"] for m in conversation]
    for m in log:
        assert m["token_ids"].dtype == torch.int64


def test_formatted_chatml_messages_hold_their_own_turns(tiny_tokenizer):
    log = get_formatted_message_log(
        CONVERSATIONS["system-user"], tiny_tokenizer, add_generation_prompt=True
    )
    assert [tiny_tokenizer.decode(m["token_ids"]) for m in log] == [
        "<|im_start|>system\nYou are a calculator.<|im_end|>\n",
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    ]
    im_start, im_end = tiny_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert log[0]["token_ids"][0].item() == im_start
    assert log[1]["token_ids"].tolist().count(im_start) == 2
    assert log[1]["token_ids"].tolist().count(im_end) == 1


def test_formatted_llama3_messages_hold_their_own_turns(llama3_tokenizer):
    log = get_formatted_message_log(CONVERSATIONS["ends-with-assistant"], llama3_tokenizer)
    assert [llama3_tokenizer.decode(m["token_ids"]) for m in log] == [
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nGuess the number<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n<guess>50</guess><|eot_id|>",
    ]


def test_formatted_message_log_keeps_other_keys_and_leaves_the_input_alone(tiny_tokenizer):
    conversation = [{"role": "user", "content": "hi", "extra": {"n": 1}}]
    log = get_formatted_message_log(conversation, tiny_tokenizer)
    assert log[0]["extra"] == {"n": 1}
    assert log[0]["content"] == "hi"
    assert tiny_tokenizer.decode(log[0]["token_ids"]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert conversation == [{"role": "user", "content": "hi", "extra": {"n": 1}}]


def test_formatted_message_log_of_an_empty_log_is_empty(tiny_tokenizer):
    assert get_formatted_message_log([], tiny_tokenizer) == []


def test_add_bos_token_does_not_double_a_bos_the_template_renders(llama3_tokenizer):
    bos = llama3_tokenizer.bos_token_id
    conversation = CONVERSATIONS["system-user"]
    for add_bos_token in (True, False):
        ids = _concat_ids(
            get_formatted_message_log(conversation, llama3_tokenizer, add_bos_token=add_bos_token)
        )
        assert ids == chat_template_ids(llama3_tokenizer, conversation, False)
        assert ids[0] == bos
        assert ids.count(bos) == 1


def test_add_bos_token_prepends_bos_when_the_template_does_not():
    tokenizer = build_llama3_tokenizer(LLAMA3_NO_BOS_TEMPLATE)
    bos = tokenizer.bos_token_id
    conversation = CONVERSATIONS["system-user"]
    expected = chat_template_ids(tokenizer, conversation, True)
    assert expected[0] != bos
    log = get_formatted_message_log(conversation, tokenizer, add_generation_prompt=True)
    assert log[0]["token_ids"][0].item() == bos
    assert log[1]["token_ids"].tolist() == expected[len(log[0]["token_ids"]) - 1 :]
    assert _concat_ids(log) == [bos, *expected]
    unchanged = get_formatted_message_log(
        conversation, tokenizer, add_bos_token=False, add_generation_prompt=True
    )
    assert _concat_ids(unchanged) == expected


def test_add_bos_token_without_a_bos_token_changes_nothing(tiny_tokenizer):
    assert tiny_tokenizer.bos_token_id is None
    conversation = CONVERSATIONS["user"]
    ids = _concat_ids(get_formatted_message_log(conversation, tiny_tokenizer, add_bos_token=True))
    assert ids == chat_template_ids(tiny_tokenizer, conversation, False)


def test_add_eos_token_keeps_the_eos_the_template_already_ends_with(chat_tokenizer):
    conversation = CONVERSATIONS["ends-with-assistant"]
    ids = _concat_ids(get_formatted_message_log(conversation, chat_tokenizer, add_eos_token=True))
    assert ids == chat_template_ids(chat_tokenizer, conversation, False)
    assert ids.count(chat_tokenizer.eos_token_id) == 2


@pytest.mark.parametrize(
    "tokenizer_builder",
    [
        lambda: build_llama3_tokenizer(eos_token="<|end_of_text|>"),
        lambda: build_chatml_tokenizer(PLAIN_TEMPLATE),
    ],
    ids=["llama3-base", "plain"],
)
def test_add_eos_token_appends_eos_when_the_last_message_has_none(tokenizer_builder):
    tokenizer = tokenizer_builder()
    eos = tokenizer.eos_token_id
    conversation = CONVERSATIONS["ends-with-assistant"]
    expected = chat_template_ids(tokenizer, conversation, False)
    assert eos not in expected

    log = get_formatted_message_log(conversation, tokenizer, add_eos_token=True)
    assert log[-1]["token_ids"][-1].item() == eos
    assert _concat_ids(log) == [*expected, eos]
    assert eos not in log[0]["token_ids"].tolist()

    without = get_formatted_message_log(conversation, tokenizer, add_eos_token=False)
    assert _concat_ids(without) == expected

    with_prompt = get_formatted_message_log(
        conversation, tokenizer, add_eos_token=True, add_generation_prompt=True
    )
    assert _concat_ids(with_prompt) == chat_template_ids(tokenizer, conversation, True)
    assert eos not in _concat_ids(with_prompt)


def test_task_data_spec_prompt_formats_the_first_user_message(tiny_tokenizer, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Solve: {}")
    spec = TaskDataSpec(task_name="math", prompt_file=prompt_file)
    assert spec.prompt == "Solve: {}"
    conversation = CONVERSATIONS["system-user"]
    log = get_formatted_message_log(conversation, tiny_tokenizer, spec)
    assert log[1]["content"] == "Solve: What is 2 + 3?"
    assert log[0]["content"] == "You are a calculator."
    prompted = [conversation[0], {**conversation[1], "content": "Solve: What is 2 + 3?"}]
    assert _concat_ids(log) == chat_template_ids(tiny_tokenizer, prompted, False)
    same = get_formatted_message_log(conversation, tiny_tokenizer, task_data_spec=spec)
    assert _concat_ids(same) == _concat_ids(log)
    assert conversation[1]["content"] == "What is 2 + 3?"


def test_task_data_spec_without_a_prompt_changes_nothing(tiny_tokenizer):
    conversation = CONVERSATIONS["user"]
    log = get_formatted_message_log(conversation, tiny_tokenizer, TaskDataSpec(task_name="t"))
    assert _concat_ids(log) == chat_template_ids(tiny_tokenizer, conversation, False)
    with pytest.raises(FileNotFoundError, match="prompt_file='missing.txt' does not exist"):
        TaskDataSpec(prompt_file="missing.txt")


def test_a_positional_bool_after_the_tokenizer_is_refused(tiny_tokenizer):
    with pytest.raises(TypeError, match="third parameter is task_data_spec"):
        get_formatted_message_log(CONVERSATIONS["user"], tiny_tokenizer, False)  # type: ignore[arg-type]


def test_tools_reach_the_chat_template():
    tokenizer = build_chatml_tokenizer(
        "{% if tools %}TOOLS:{{ tools | length }}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    )
    conversation = CONVERSATIONS["system-user"]
    log = get_formatted_message_log(
        conversation, tokenizer, tools=[{"name": "add"}, {"name": "mul"}], add_eos_token=False
    )
    assert tokenizer.decode(log[0]["token_ids"]).startswith("TOOLS:2")
    without = get_formatted_message_log(conversation, tokenizer, add_eos_token=False)
    assert "TOOLS" not in tokenizer.decode(torch.cat([m["token_ids"] for m in without]))


def test_debug_prints_each_turns_chunk(tiny_tokenizer, capsys):
    get_formatted_message_log(CONVERSATIONS["system-user"], tiny_tokenizer)
    assert capsys.readouterr().out == ""
    get_formatted_message_log(CONVERSATIONS["system-user"], tiny_tokenizer, debug=True)
    out = capsys.readouterr().out
    assert "DEBUG: Individual message turns from apply_chat_template" in out
    assert "[Turn 2/2] Role: user" in out
    assert repr("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n") in out
    assert "DEBUG: Complete formatted conversation:" in out


def test_get_first_index_that_differs():
    assert get_first_index_that_differs("abc", "abc") == 3
    assert get_first_index_that_differs("abc", "abd") == 2
    assert get_first_index_that_differs("", "x") == 0
    assert get_first_index_that_differs("xyz", "xy") == 2


def test_loss_mask_roles_compare_case_insensitively():
    logs = [[_message("Assistant", [1]), _message("user", [2])]]
    add_loss_mask_to_message_log(logs, roles_to_train_on=["ASSISTANT"])
    assert _masks(logs) == [[[True], [False]]]


def test_a_template_that_rewrites_earlier_turns_raises_a_clear_error():
    tokenizer = build_chatml_tokenizer(CHATML_STRIP_THINKING_TEMPLATE)
    conversation = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>2 plus 3</think>The answer is 5."},
        {"role": "user", "content": "correct"},
    ]
    with pytest.raises(
        ValueError,
        match=re.escape(
            "renders messages[:2] as text that is not a prefix of its rendering of messages[:3]"
        ),
    ):
        get_formatted_message_log(conversation, tokenizer)
    # Without an earlier assistant turn to rewrite, the template is prefix-stable.
    log = get_formatted_message_log(conversation[:2], tokenizer)
    assert _concat_ids(log) == chat_template_ids(tokenizer, conversation[:2], False)


def test_formatted_message_log_without_a_chat_template_raises():
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat_template"):
        get_formatted_message_log(CONVERSATIONS["user"], tokenizer)
