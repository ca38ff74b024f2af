"""Pulling answers out of model responses: tagged spans and ``\\boxed{...}``.

Every function here takes time linear in the length of the text (a response can be
megabytes long): each scans the text a bounded number of times, never again from every
opening tag or brace.
"""

from __future__ import annotations

import re

_BRACE = re.compile(r"[{}]")


def extract_tag(text: str, tag: str) -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text``; None when absent.
    Spans pair as a left-to-right reading pairs them (each ``<tag>`` with the first
    ``</tag>`` after it, the next span starting after that), so ``<a>1<a>2</a>`` reads ``1<a>2``.

    >>> extract_tag("<answer> 4 </answer> then <answer>5</answer>", "answer")
    '5'
    >>> extract_tag("<answer>unclosed", "answer") is None
    True
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    last, start = None, text.find(opening)
    while start >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:  # no later <tag> is closed either
            break
        last = (start + len(opening), end)
        start = text.find(opening, end + len(closing))
    return None if last is None else text[last[0] : last[1]].strip()


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
    if start < 0:
        return None
    closing = closing_braces(text)
    while start >= 0:
        brace = start + len("\\boxed{") - 1
        if brace in closing:
            return text[brace + 1 : closing[brace]]
        start = text.rfind("\\boxed{", 0, start)
    return None


def closing_braces(text: str) -> dict[int, int]:
    """Where each ``{`` of ``text`` that is closed is closed (nested braces balanced): the
    index of the ``{`` -> the index of its ``}``, in one pass.

    >>> closing_braces("}{a{b}}{")
    {3: 5, 1: 6}
    """
    open_at: list[int] = []
    closing: dict[int, int] = {}
    for brace in _BRACE.finditer(text):
        if brace[0] == "{":
            open_at.append(brace.start())
        elif open_at:
            closing[open_at.pop()] = brace.start()
    return closing


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
