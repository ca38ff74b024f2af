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


def after_thinking(text: str) -> str:
    """The part of ``text`` that is the final answer, not the thinking: what follows the
    last ``</think>`` (a chat template may have opened the thinking in the prompt), cut
    before any ``<think>`` that opens again and is never closed (unfinished thinking gives
    no answer).

    >>> after_thinking(r"<think>maybe \\boxed{3}</think> so \\boxed{4}")
    ' so \\\\boxed{4}'
    >>> after_thinking("opened by the template</think>42"), after_thinking("<think>still going")
    ('42', '')
    >>> after_thinking("no thinking at all")
    'no thinking at all'
    """
    close = text.rfind("</think>")
    if close >= 0:
        text = text[close + len("</think>") :]
    opened = text.find("<think>")
    return text if opened < 0 else text[:opened]


def last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    """The last (non-overlapping) match of ``pattern`` in ``text``; None when there is none.

    >>> last_match(re.compile(r"\\d+"), "1 then 22 then 333").group()
    '333'
    """
    found = None
    for found in pattern.finditer(text):  # noqa: B007 (the loop keeps the last one)
        pass
    return found
