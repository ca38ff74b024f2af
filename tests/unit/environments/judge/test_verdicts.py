"""Verdict parsers: exact scores, every way a reply can be unreadable, and linear time on
adversarial replies."""

from __future__ import annotations

import pytest

from envloop.environments.judge.config import validate_config
from envloop.environments.judge.verdicts import (
    VerdictError,
    aggregate,
    group_verdicts,
    parse_verdict,
)


def verdict(**options):
    return validate_config({"verdict": options})["verdict"]


@pytest.mark.parametrize(
    ("text", "score"),
    [("reference 85; reply 85: yes", 1.0), ("Yes.", 1.0), ("yes... no", 0.0), ("NO", 0.0)],
)
def test_yes_no_reads_the_last_word(text, score):
    assert parse_verdict(text, verdict(kind="yes_no"), 1000) == score


def test_yes_no_words_are_whole_words_and_configurable():
    with pytest.raises(VerdictError, match="no yes or no"):
        parse_verdict("nobody says yesterday", verdict(kind="yes_no"), 1000)
    custom = verdict(kind="yes_no", yes=["correct"], no=["incorrect"])
    assert parse_verdict("Incorrect", custom, 1000) == 0.0
    assert parse_verdict("it is correct", custom, 1000) == 1.0


def test_number_in_range_is_normalised():
    assert parse_verdict("I give it 7.5", verdict(kind="number", min=0, max=10), 100) == 0.75
    score = verdict(kind="number", min=1, max=5, after="Score:")
    assert parse_verdict("3 of 4 rubric items. Score: 4 (of 5)", score, 100) == 0.75
    with pytest.raises(VerdictError, match=r"score 11 is outside \[0, 10\]"):
        parse_verdict("11", verdict(kind="number"), 100)
    with pytest.raises(VerdictError, match="no 'Score:'"):
        parse_verdict("7", score, 100)
    with pytest.raises(VerdictError, match="no number"):
        parse_verdict("great", verdict(kind="number"), 100)


def test_json_field_of_the_last_object():
    j = verdict(kind="json", field="eval.score", min=0, max=4)
    text = 'draft {"eval": {"score": 9}} final {"eval": {"score": 3}} done'
    assert parse_verdict(text, j, 1000) == 0.75
    assert parse_verdict('{"pass": true}', verdict(kind="json", field="pass"), 100) == 1.0
    with pytest.raises(VerdictError, match="no field 'eval.score'"):
        parse_verdict('{"eval": 1}', j, 100)
    with pytest.raises(VerdictError, match="no JSON object"):
        parse_verdict("{not json", j, 100)
    with pytest.raises(VerdictError, match="str, not a number"):
        parse_verdict('{"eval": {"score": "high"}}', j, 100)


def test_label_choice():
    labels = verdict(kind="label", labels={"A": 1.0, "B": 0.5, "C": 0.0})
    assert parse_verdict("Between A and C I pick C", labels, 100) == 0.0
    assert parse_verdict("Answer: B.", labels, 100) == 0.5
    with pytest.raises(VerdictError, match="none of the labels A, B, C"):
        parse_verdict("a b c ABC", labels, 100)


def test_only_the_last_max_chars_are_read():
    with pytest.raises(VerdictError):
        parse_verdict("yes" + " " * 50, verdict(kind="yes_no"), 10)


def test_group_lines():
    yn = verdict(kind="yes_no")
    text = "85\n1: reply 85, yes\nReply 2: reply 86, no\n3) maybe\n1: reply 85, no"
    scores = group_verdicts(text, 4, yn, 1000)
    assert scores[:2] == [0.0, 0.0]  # the last line of a number counts
    assert str(scores[2]) == "reply 3: no yes or no in the judge's reply"
    assert str(scores[3]) == "no verdict line '4: ...' for reply 4"


def test_aggregate():
    assert aggregate([1.0, 0.0, 1.0, 1.0], "mean") == 0.75
    assert aggregate([0.2, 0.2, 0.9], "majority") == 0.2
    assert aggregate([1.0, 0.0], "majority") == 0.5


@pytest.mark.parametrize(
    "options",
    [
        {"kind": "yes_no"},
        {"kind": "number"},
        {"kind": "number", "after": "Score:"},
        {"kind": "json"},
        {"kind": "label", "labels": {"A": 1.0, "B": 0.0}},
    ],
)
def test_adversarial_replies_are_refused(options):
    """Replies built to make naive parsers quadratic (many openings and no closing, a
    number of 100,000 digits): each is refused with its reason (the parsers read the last
    100,000 characters once; the JSON parser tries at most 16 openings)."""
    v = verdict(**options)
    for text in ["{" * 200_000, '{"a":' * 40_000, "Score:" * 33_000, "1" * 200_000]:
        with pytest.raises(VerdictError):
            parse_verdict(text, v, 100_000)
