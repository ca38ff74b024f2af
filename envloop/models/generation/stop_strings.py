"""Detecting stop strings in generated text by decoding only the last few tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens decoded before the newest one, per character of the longest stop string, plus a
# margin: a byte-level token can hold a single byte of a 4-byte character, and the first
# tokens of a window may decode differently from the full text (a split character, a
# stripped leading space).
_TOKENS_PER_CHAR = 4
_MARGIN_TOKENS = 8


def tail_window(stop_strings: Sequence[str]) -> int:
    """How many trailing tokens to decode so any stop string ending in the newest one shows.

    >>> tail_window(["</action>"])
    44
    """
    return _TOKENS_PER_CHAR * max(len(s) for s in stop_strings) + _MARGIN_TOKENS


def stop_string_hits(
    tokenizer: Any, generated: Sequence[Sequence[int]], stop_strings: Sequence[Sequence[str]]
) -> list[bool]:
    """For each sample, whether the text of ``generated[i]`` holds one of ``stop_strings[i]``.

    Called after every new token, so a stop string found here was completed by the newest
    token: generation stops at the token that finishes the stop string. That token is kept
    whole, so when it runs past the stop string the text goes on a few characters after it.
    Only the last :func:`tail_window` tokens of each sample are decoded, all in one call.
    Special tokens are decoded as text (a stop string may name one).
    """
    tails = [list(ids[-tail_window(stops) :]) for ids, stops in zip(generated, stop_strings)]
    texts = tokenizer.batch_decode(
        tails, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return [any(s in text for s in stops) for text, stops in zip(texts, stop_strings)]
