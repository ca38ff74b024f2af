"""The direct-to-Rust tokenize/decode paths give exactly what transformers' wrapper gives."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from envloop.data.tokenization import decode_texts, tokenize_texts
from tests.fixtures.tiny_models import build_tiny_tokenizer

TOKENIZER = build_tiny_tokenizer()
TEXTS = [
    "",
    "What is 2 + 3?",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  spaced \n\n out  ",
    "ünïcödé ✓",
]


def test_tokenize_matches_the_wrapper():
    expected = TOKENIZER(TEXTS, add_special_tokens=False)["input_ids"]
    assert tokenize_texts(TOKENIZER, TEXTS) == expected


def test_decode_matches_the_wrapper_and_keeps_special_tokens():
    ids = TOKENIZER(TEXTS, add_special_tokens=False)["input_ids"]
    # (transformers' batch_decode([]) returns [''], so compare sample by sample)
    assert decode_texts(TOKENIZER, ids) == [
        TOKENIZER.decode(i, skip_special_tokens=False) for i in ids
    ]
    assert decode_texts(TOKENIZER, ids)[2] == TEXTS[2]
    assert decode_texts(TOKENIZER, []) == []


def test_a_tokenizer_that_pads_falls_back_to_the_wrapper():
    padded = copy.deepcopy(TOKENIZER)
    padded.backend_tokenizer.enable_padding(pad_id=TOKENIZER.pad_token_id)
    out = tokenize_texts(padded, ["a", "a much longer text"])
    assert out == [
        TOKENIZER.encode(t, add_special_tokens=False) for t in ["a", "a much longer text"]
    ]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=8))
def test_round_trip_on_arbitrary_text(texts):
    ids = tokenize_texts(TOKENIZER, texts)
    assert ids == [TOKENIZER.encode(t, add_special_tokens=False) for t in texts]
    # (transformers' batch_decode([]) returns [''], so compare sample by sample)
    assert decode_texts(TOKENIZER, ids) == [
        TOKENIZER.decode(i, skip_special_tokens=False) for i in ids
    ]
