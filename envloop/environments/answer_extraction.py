"""Pulling answers out of model responses: tagged spans and ``\\boxed{...}``."""

from __future__ import annotations

import re


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text``; None when absent.

    >>> extract_tag("<answer> 4 </answer> then <answer>5</answer>", "answer")
    '5'
    >>> extract_tag("<answer>unclosed", "answer") is None
    True
    """
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return matches[-1].strip() if matches else None


def has_tag_pair(text: str, tag: str) -> bool:
    """Whether ``text`` holds an opening ``<tag>`` followed later by ``</tag>``.

    >>> has_tag_pair("<think>hmm</think>", "think"), has_tag_pair("</think><think>", "think")
    (True, False)
    """
    start = text.find(f"<{tag}>")
    return start >= 0 and text.find(f"</{tag}>", start) >= 0


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced); None when absent.

    >>> extract_boxed(r"so \\boxed{\\frac{1}{2}} and \\boxed{3}")
    '3'
    >>> extract_boxed(r"\\boxed{\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_boxed(r"\\boxed{unbalanced") is None
    True
    """
    start = text.rfind("\\boxed{")
    while start >= 0:
        content = _balanced(text, start + len("\\boxed{"))
        if content is not None:
            return content
        start = text.rfind("\\boxed{", 0, start)
    return None


def _balanced(text: str, open_at: int) -> str | None:
    depth = 1
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at:i]
    return None
