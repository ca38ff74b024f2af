"""How alike two pieces of code are: Jaccard similarity of their sets of code tokens
(:func:`code_jaccard`), or of their words as NeMo-RL's environment scores them
(:func:`word_jaccard`).

**Code** is the content of the text's fenced blocks (```` ```lang ... ``` ````, all of them,
joined; a fence left open, as in a response cut off at its token budget, runs to the end);
text without a fence is code as a whole.

**Code tokens** come from one regular expression that fits most programming languages, so
non-Python code and code that does not parse tokenize too: string literals (quotes
included, one token each; a quote whose string is not closed on its line is a token on
its own), identifiers and keywords, numbers, multi-character operators
(``==``, ``->``, ``**=``, ...), and every other non-space character on its own. Tokens are
case-sensitive; whitespace and layout do not count, and neither do repeats (sets).
"""

from __future__ import annotations

import re

_FENCED_BLOCK = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)(?:^[ \t]*```|\Z)", re.S | re.M)

_STRINGS = {  # a quote and its string; the closing quote is missing when the string is unclosed
    '"': r'(?P<double>"(?:\\.|[^"\\\n])*+)(?P<double_end>")?',
    "'": r"(?P<single>'(?:\\.|[^'\\\n])*+)(?P<single_end>')?",
}
_UNCLOSED = {"double": '"', "single": "'"}
"""The group a match ends in when it is an unclosed string -> its quote."""
_OTHER_TOKENS = r"""
    [^\W\d]\w*                                # identifier or keyword
    | 0[xXoObB][0-9a-fA-F_]+                  # 0x1F, 0o17, 0b101
    | \d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?     # 42, 3.14, 1e-9, 1_000
    | \*\*=? | //=? | <<=? | >>=? | \.\.\.     # Python's long operators
    | [-+*/%&|^=!<>:]= | -> | => | && | \|\| | :: | \+\+ | --
    | \S                                      # any other character: ( ) [ ] , . # ...
"""


def _token_pattern(quotes: str) -> re.Pattern[str]:
    """The code-token pattern with string literals for the quotes in ``quotes`` only."""
    return re.compile("|".join([*(_STRINGS[q] for q in quotes), _OTHER_TOKENS]), re.X)


_CODE_TOKEN = {quotes: _token_pattern(quotes) for quotes in ("\"'", '"', "'", "")}


def extract_code(text: str) -> str:
    """The code in ``text``: its fenced blocks joined by newlines, else the whole text.

    >>> extract_code("Use this:\\n```python\\nx = 1\\n```\\nand\\n```\\ny = 2\\n```")
    'x = 1\\n\\ny = 2\\n'
    >>> extract_code("x = a + b")
    'x = a + b'
    """
    blocks = _FENCED_BLOCK.findall(text)
    return "\n".join(blocks) if blocks else text


def code_tokens(code: str) -> list[str]:
    """The code tokens of ``code``, in order (see the module docstring).

    >>> code_tokens("print('hi, you')  # x**=2")
    ['print', '(', "'hi, you'", ')', '#', 'x', '**=', '2']
    """
    return _tokens(code, 0, len(code), "\"'")


def _tokens(code: str, start: int, end: int, quotes: str) -> list[str]:
    """The code tokens of ``code[start:end]``, where strings of only the quotes in ``quotes``
    can close.

    A quote whose string is unclosed is a token on its own, and the text after it is
    tokenized as usual: up to where that string stops (its line's end, or the code's), no
    string of that quote closes either (each would stop at the same place), so that text is
    tokenized once, without them, never rescanned from each quote in it.
    """
    tokens = []
    for match in _CODE_TOKEN[quotes].finditer(code, start, end):
        quote = _UNCLOSED.get(match.lastgroup or "")
        if quote is None:
            tokens.append(match[0])
        else:
            tokens.append(quote)
            tokens += _tokens(code, match.start() + 1, match.end(), quotes.replace(quote, ""))
    return tokens


def jaccard_similarity(a: set[str], b: set[str]) -> float:
    """``|a & b| / |a | b|``; 0.0 when both are empty.

    >>> jaccard_similarity({"a", "b", "c"}, {"b", "c", "d"})
    0.5
    """
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def word_jaccard(response: str, reference: str) -> float:
    """NeMo-RL's ``code_jaccard`` score, in [0, 1]: both texts stripped and lower-cased;
    1.0 when they are equal; else the Jaccard similarity of their sets of
    whitespace-separated words times the ratio of their lengths in characters (the shorter
    over the longer); 0.0 when the reference has no words.

    >>> word_jaccard("Return A + B", "return a + b")
    1.0
    >>> word_jaccard("import os\\nprint(os.getcwd())", "def add(a, b):\\n    return a + b")
    0.0
    >>> word_jaccard("return a", "return a + b")  # 2 of 4 words, 8 of 12 characters
    0.3333333333333333
    """
    a, b = response.strip().lower(), reference.strip().lower()
    if a == b:
        return 1.0
    words_a, words_b = set(a.split()), set(b.split())
    if not words_b:
        return 0.0
    length_ratio = min(len(a), len(b)) / max(len(a), len(b), 1)
    return min(1.0, max(0.0, jaccard_similarity(words_a, words_b) * length_ratio))


def code_jaccard(response: str, reference: str) -> float:
    """The Jaccard similarity of the code tokens of the code in ``response`` and in
    ``reference``, in [0, 1].

    >>> code_jaccard("```py\\nreturn a+b\\n```", "return a + b")
    1.0
    >>> code_jaccard("x = a + b", "return a + b")
    0.5
    """
    return jaccard_similarity(
        set(code_tokens(extract_code(response))), set(code_tokens(extract_code(reference)))
    )
