"""Detecting stop strings incrementally, one new token at a time.

A :class:`StopWatcher` per sample keeps only what a stop string could still need (its tail)
and looks at each new token once, so the cost per token does not grow with the stop
strings' or the response's length. Byte-level BPE tokenizers (GPT-2, Qwen, Llama 3 and the
bundled policy) map every token to fixed bytes, which :class:`TokenBytes` reads from the
vocabulary once per token id; other tokenizers are decoded incrementally from a moving
offset (decoding only the tokens since the last complete character).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenBytes:
    """The UTF-8 bytes each token id decodes to, for tokenizers whose decoding is the
    concatenation of per-token bytes (a ``ByteLevel`` decoder); ``None`` from :meth:`of`
    when the tokenizer is not one of those. Special and added tokens decode to their text.

    >>> from envloop.models.tiny import build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> ids = tokenizer.encode("héllo </tool>", add_special_tokens=False)
    >>> table = TokenBytes(tokenizer)
    >>> b"".join(table.of(i) for i in ids).decode()
    'héllo </tool>'
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._byte_of = _byte_level_alphabet()
        self._added = {int(i): token.content for i, token in tokenizer.added_tokens_decoder.items()}
        self._bytes: dict[int, bytes] = {}

    def of(self, token_id: int) -> bytes | None:
        """The bytes of ``token_id``, or None when tokens do not map to fixed bytes."""
        if not self.byte_level:
            return None
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._read(token_id)
        return cached

    def _read(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the vocabulary: decodes to nothing
            return b""
        if all(char in self._byte_of for char in piece):
            return bytes(self._byte_of[char] for char in piece)
        return piece.encode()  # a normal added token stored as plain text


class StopWatcher:
    """Whether a sample's generated text has come to hold one of its stop strings.

    :meth:`add` takes each generated token in turn and returns True at the token that
    completes a stop string (special tokens count as their text, as a stop string may name
    one). Only the last ``len(longest stop string) - 1`` bytes (or characters) seen are
    kept, plus the token being looked at. With a tokenizer whose decoding of earlier tokens
    can change with later ones (SentencePiece byte-fallback runs that turn out not to be
    UTF-8 decode to one U+FFFD per byte), text is matched as it decoded when it came.

    >>> from envloop.models.tiny import build_tiny_tokenizer
    >>> tokenizer = build_tiny_tokenizer()
    >>> watcher = StopWatcher(["</tool>"], TokenBytes(tokenizer), tokenizer)
    >>> [watcher.add(i) for i in tokenizer.encode("a </tool> b", add_special_tokens=False)][-3:]
    [False, True, False]
    """

    def __init__(
        self, stop_strings: Sequence[str], token_bytes: TokenBytes, tokenizer: Any
    ) -> None:
        self.token_bytes, self.tokenizer = token_bytes, tokenizer
        self.stops_bytes = [s.encode() for s in stop_strings]
        self.stops_text = list(stop_strings)
        self.keep = max(len(s) for s in self.stops_bytes) - 1
        self.tail_bytes = b""
        # A stop string naming U+FFFD (what a split character decodes to) is matched in
        # decoded text, as the bytes never hold it.
        self.by_bytes = token_bytes.byte_level and not any("\ufffd" in s for s in stop_strings)
        # Decoding fallback: every token so far, and where the last two decodes started
        # (the earlier tokens give the newest ones their context, e.g. a leading space).
        self.tail_text = ""
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int) -> bool:
        """Take the next generated token; True when a stop string ends within it."""
        piece = self.token_bytes.of(token_id) if self.by_bytes else None
        if piece is None:
            return self._add_decoded(token_id)
        window = self.tail_bytes + piece
        self.tail_bytes = window[-self.keep :] if self.keep else b""
        return any(stop in window for stop in self.stops_bytes)

    def _add_decoded(self, token_id: int) -> bool:
        """The new text is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``.
        While the newest tokens end inside a character (decoded as U+FFFD) the offsets stay,
        so the character is decoded whole once its last byte comes."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        window = self.tail_text + after[len(before) :]
        if not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.tail_text = window[-self.keep :] if self.keep else ""
        return any(stop in window for stop in self.stops_text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE token stands for: printable Latin-1
    bytes stand for themselves, the other bytes (control characters, space, ...) for the
    characters from U+0100 on, in byte order (the GPT-2 convention).

    >>> alphabet = _byte_level_alphabet()
    >>> alphabet["A"], alphabet["Ġ"], alphabet["Ċ"], len(alphabet)
    (65, 32, 10, 256)
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return alphabet
