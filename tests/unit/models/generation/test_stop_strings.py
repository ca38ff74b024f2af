"""Incremental stop-string detection agrees with searching the fully decoded text."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from envloop.models.generation.stop_strings import StopWatcher, TokenBytes
from envloop.models.tiny import SPECIAL_TOKENS, TRAINING_CORPUS, build_tiny_tokenizer


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (``▁`` for spaces, byte fallback, leading space stripped
    on decoding): its tokens do not map to fixed bytes, so the watcher decodes."""
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *SPECIAL_TOKENS, *byte_tokens], show_progress=False
    )
    backend.train_from_iterator(TRAINING_CORPUS * 4 + ["héllo wörld € ✓"], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


TOKENIZERS = {"byte_level": build_tiny_tokenizer, "metaspace": metaspace_tokenizer}


def first_hit_by_decoding(tokenizer, ids: list[int], stops: list[str]) -> int | None:
    """The reference: the first n whose decoded text ``ids[:n]`` holds a stop string."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(
            ids[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        if any(stop in text for stop in stops):
            return n
    return None


def first_hit_incremental(tokenizer, ids: list[int], stops: list[str]) -> int | None:
    watcher = StopWatcher(stops, TokenBytes(tokenizer), tokenizer)
    return next((n + 1 for n, token in enumerate(ids) if watcher.add(token)), None)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_first_hit_equals_searching_the_decoded_text(kind):
    tokenizer = TOKENIZERS[kind]()
    assert TokenBytes(tokenizer).byte_level == (kind == "byte_level")
    rng = random.Random(0)
    # Byte-fallback tokens are left out of random ids: a run of them that is not UTF-8
    # decodes to one U+FFFD per byte, which changes how earlier bytes of the run decode
    # (text no incremental reading can match). Real text below still uses them.
    vocab = [
        i for i in range(len(tokenizer)) if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")
    ]
    texts = [*TRAINING_CORPUS, "héllo wörld € ✓ </tool> <|im_end|> done", "a  b\n\nc"]
    checked = 0
    for trial in range(300):
        if trial % 2:  # real text, stop strings cut from it
            ids = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        else:  # random ids: split characters, special tokens, odd byte runs
            ids = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        start = rng.randrange(len(text)) if text else 0
        stop = text[start : start + rng.randint(1, 8)] or "x"
        stops = [stop, "never appears here"]
        assert first_hit_incremental(tokenizer, ids, stops) == first_hit_by_decoding(
            tokenizer, ids, stops
        ), (ids, stops)
        checked += 1
    assert checked == 300


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_a_stop_string_split_across_many_tokens_is_found_at_its_last_token(kind):
    tokenizer = TOKENIZERS[kind]()
    ids = tokenizer.encode("the answer is </tool> and more", add_special_tokens=False)
    hit = first_hit_incremental(tokenizer, ids, ["</tool>"])
    assert hit == first_hit_by_decoding(tokenizer, ids, ["</tool>"])
    assert tokenizer.decode(ids[:hit]).endswith("</tool>")


def test_special_tokens_count_as_their_text():
    tokenizer = build_tiny_tokenizer()
    ids = [*tokenizer.encode("done", add_special_tokens=False), tokenizer.eos_token_id]
    assert first_hit_incremental(tokenizer, ids, ["<|im_end|>"]) == len(ids)
