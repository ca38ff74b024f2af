"""Reading a judge's reply as a score in [0, 1].

Every parser reads at most the reply's last ``max_chars`` characters (a verdict comes at the
end) in time linear in them, and raises :class:`VerdictError` saying why a reply cannot be
read:

- ``yes_no``: the last of the ``yes`` / ``no`` words (whole words, any case): 1 or 0;
- ``number``: the last number (or the first after the last ``after``), within
  ``[min, max]``, mapped linearly onto [0, 1];
- ``json``: ``field`` (dotted for nested objects) of the last JSON object, a number within
  ``[min, max]`` (mapped as above) or a bool;
- ``label``: the last of ``labels`` (whole words, case as given), its score.

:func:`group_verdicts` reads a group judgement: one line ``<k>: <verdict>`` per reply
(``Reply 2: ...`` and ``2) ...`` too), each read by the parser; the last line of a number
counts.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["VerdictError", "aggregate", "group_verdicts", "parse_verdict"]

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_LINE = re.compile(r"\s*(?:reply\s+)?(\d{1,6})\s*[:.)]\s?(.*)", re.IGNORECASE)
MAX_JSON_TRIES = 16
"""Most ``{`` positions (from the end) tried as the start of the last JSON object."""


class VerdictError(ValueError):
    """A judge reply that cannot be read as a verdict; the message says why."""


def parse_verdict(text: str, verdict: Mapping[str, Any], max_chars: int) -> float:
    """The score in [0, 1] of judge reply ``text`` under ``verdict`` (a validated
    ``VerdictConfig``). Raises :class:`VerdictError`.

    >>> parse_verdict("85 vs 86: no", {"kind": "yes_no", "yes": ["yes"], "no": ["no"]}, 100)
    0.0
    >>> number = {"kind": "number", "min": 0, "max": 10, "after": "Score:"}
    >>> parse_verdict("Score: 7/10", number, 100)
    0.7
    """
    text = text[-max_chars:]
    kind = verdict["kind"]
    if kind == "yes_no":
        return _yes_no(text, verdict["yes"], verdict["no"])
    if kind == "number":
        return _number(text, verdict)
    if kind == "json":
        return _json_field(text, verdict)
    return _label(text, verdict["labels"])


def group_verdicts(
    text: str, size: int, verdict: Mapping[str, Any], max_chars: int
) -> list[float | VerdictError]:
    """Each of ``size`` replies' score from a group judgement (see the module docstring),
    or the :class:`VerdictError` of a reply whose line is missing or unreadable.

    >>> group_verdicts("85\\n1: reply 85, yes\\n2: reply 86, no", 3,
    ...                {"kind": "yes_no", "yes": ["yes"], "no": ["no"]}, 1000)[:2]
    [1.0, 0.0]
    """
    lines: dict[int, str] = {}
    for line in text[-max_chars:].splitlines():
        match = _LINE.fullmatch(line)
        if match:
            lines[int(match.group(1))] = match.group(2)
    out: list[float | VerdictError] = []
    for k in range(1, size + 1):
        if k not in lines:
            out.append(VerdictError(f"no verdict line '{k}: ...' for reply {k}"))
            continue
        try:
            out.append(parse_verdict(lines[k], verdict, max_chars))
        except VerdictError as exc:
            out.append(VerdictError(f"reply {k}: {exc}"))
    return out


def aggregate(scores: list[float], how: str) -> float:
    """One score from several judgements: their ``mean``, or (``majority``) the most common
    score (the mean of the most common ones when several tie).

    >>> aggregate([1.0, 0.0, 1.0], "majority"), aggregate([1.0, 0.0], "majority")
    (1.0, 0.5)
    """
    if how == "mean":
        return sum(scores) / len(scores)
    counts = Counter(scores)
    top = max(counts.values())
    tied = [score for score, n in counts.items() if n == top]
    return sum(tied) / len(tied)


def _yes_no(text: str, yes: list[str], no: list[str]) -> float:
    words = {w.lower(): 1.0 for w in yes} | {w.lower(): 0.0 for w in no}
    found = _last_word(text, list(words), re.IGNORECASE)
    if found is None:
        raise VerdictError(f"no {'/'.join(yes)} or {'/'.join(no)} in the judge's reply")
    return words[found.lower()]


def _label(text: str, labels: Mapping[str, float]) -> float:
    found = _last_word(text, list(labels), 0)
    if found is None:
        raise VerdictError(f"none of the labels {', '.join(labels)} in the judge's reply")
    return float(labels[found])


def _last_word(text: str, words: list[str], flags: int) -> str | None:
    """The last of ``words`` in ``text`` as a whole word (longest first at one position)."""
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    last = _last(re.finditer(rf"(?<!\w)(?:{alternatives})(?!\w)", text, flags))
    return None if last is None else last.group(0)


def _last(matches: Iterator[re.Match[str]]) -> re.Match[str] | None:
    kept = deque(matches, maxlen=1)
    return kept[0] if kept else None


def _number(text: str, verdict: Mapping[str, Any]) -> float:
    after = verdict.get("after")
    if after:
        start = text.rfind(after)
        if start < 0:
            raise VerdictError(f"no {after!r} in the judge's reply")
        match = _NUMBER.search(text, start + len(after))
        if match is None:
            raise VerdictError(f"no number after {after!r} in the judge's reply")
    else:
        match = _last(_NUMBER.finditer(text))
        if match is None:
            raise VerdictError("no number in the judge's reply")
    return _in_range(float(match.group(0)), verdict)


def _in_range(value: float, verdict: Mapping[str, Any]) -> float:
    low, high = float(verdict["min"]), float(verdict["max"])
    if not math.isfinite(value) or not low <= value <= high:
        raise VerdictError(f"score {value:g} is outside [{low:g}, {high:g}]")
    return (value - low) / (high - low)


def _json_field(text: str, verdict: Mapping[str, Any]) -> float:
    """The field of the last JSON object: of the objects starting at the last
    :data:`MAX_JSON_TRIES` ``{``, the one ending last (the outermost of those)."""
    decoder, start, found = json.JSONDecoder(), len(text), None
    for _ in range(MAX_JSON_TRIES):
        start = text.rfind("{", 0, start)
        if start < 0:
            break
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict) and (found is None or end >= found[0]):
            found = (end, value)
    if found is None:
        raise VerdictError("no JSON object in the judge's reply")
    return _field_score(found[1], verdict)


def _field_score(obj: dict[str, Any], verdict: Mapping[str, Any]) -> float:
    value: Any = obj
    for key in verdict["field"].split("."):
        if not isinstance(value, dict) or key not in value:
            raise VerdictError(f"the judge's JSON has no field {verdict['field']!r}")
        value = value[key]
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return _in_range(float(value), verdict)
    raise VerdictError(f"field {verdict['field']!r} is {type(value).__name__}, not a number")
