"""Batched tokenize/decode that go straight to the Rust tokenizer when that is exact.

transformers' tokenizer call wraps every encoding in Python objects, which costs more than
the tokenization itself for short texts. When the tokenizer is backed by a ``tokenizers``
object with no padding or truncation configured (and, for decoding, no Python-side
clean-up of spaces), calling that object directly gives the same ids and text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def tokenize_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens added), in one batched call.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tokenize_texts(PreTrainedTokenizerFast(tokenizer_object=backend), ["a b", "b"])
    [[0, 1], [1]]
    """
    if not texts:
        return []
    backend = _exact_backend(tokenizer)
    if backend is None:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(list(texts), add_special_tokens=False)]


def decode_texts(tokenizer: Any, token_lists: Sequence[list[int]]) -> list[str]:
    """Each token list decoded to text, special tokens kept, in one batched call."""
    if not token_lists:
        return []
    backend = _exact_backend(tokenizer)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.batch_decode(list(token_lists), skip_special_tokens=False)
    return backend.decode_batch(list(token_lists), skip_special_tokens=False)


def _exact_backend(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return None
    return backend
