"""Adversarial model output: every parser the built-in environments run on a response reads
megabytes of repetitive text (unclosed boxes, tags, fences and strings, runs of digits and
spaces) in time linear in its length, with the same results as before.

No timings here, only exact results: the quadratic parsers these replaced would not finish
in reasonable time (extrapolated from their times on 10-40 KB: ``extract_boxed`` on the
1 MB of unclosed boxes below about 3 hours, ``extract_tag`` on the 1.2 MB of unclosed tags
about 20 minutes, the sliding puzzle on a 1 MB run of digits about 2 hours, ``parse_box``
on ``"[" + "1" * MB`` about 7 hours). The differential tests check the linear parsers
against the old algorithms, written out here, on random strings of the tokens that matter.
``benchmarks/adversarial_parsing.py`` measures the times.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from envloop.environments.code.similarity import code_jaccard, code_tokens, extract_code
from envloop.environments.common.answer_extraction import (
    after_thinking,
    closing_braces,
    extract_boxed,
    extract_tag,
    has_tag_pair,
)
from envloop.environments.common.math_verification import final_answer_text, normalize_answer
from envloop.environments.games.sliding_puzzle_board import _slide_square, play, solved_board
from envloop.environments.math.checks import has_one_boxed_answer, has_think_answer_format
from envloop.environments.math.dapo_answers import (
    extract_dapo_answer,
    grade_dapo,
    normalize_final_answer,
)
from envloop.environments.math.multichoice_answers import extract_choice
from envloop.environments.rewards import bbox_giou, format_reward, parse_box

MB = 1_000_000
BOXES = "\\boxed{" * 150_000  # 1 MB, none closed
TAGS = "<code>" * 200_000  # 1.2 MB, none closed


# --- answer extraction -------------------------------------------------------------------


def test_extract_boxed_on_unclosed_boxes():
    assert extract_boxed(BOXES) is None
    assert extract_boxed(BOXES + "\\boxed{42}") == "42"
    assert extract_boxed("\\boxed{7}" + BOXES) == "7"
    assert extract_boxed("\\boxed{" + "{" * 300_000) is None
    assert extract_boxed("\\boxed{" + "{}" * 150_000 + "}") == "{}" * 150_000


def test_extract_tag_on_unclosed_tags():
    assert extract_tag(TAGS, "code") is None
    assert extract_tag("<code>x = 1</code>" + TAGS, "code") == "x = 1"
    assert extract_tag(TAGS + "</code>", "code") == "<code>" * 199_999  # the first one opens
    assert extract_tag("<a></a>" * 150_000 + "<a> last </a>", "a") == "last"
    assert extract_tag("</code>" * 150_000, "code") is None


def test_tag_pairs_and_thinking_on_repeated_tags():
    assert has_tag_pair(TAGS, "code") is False
    assert has_tag_pair("</think>" * 150_000 + "<think>", "think") is False
    assert after_thinking("<think>" * 150_000) == ""
    assert after_thinking("</think>" * 150_000 + "42") == "42"


def test_closing_braces_on_long_runs_of_braces():
    assert closing_braces("}" * 300_000 + "{") == {}
    nested = closing_braces("{" * 150_000 + "}" * 150_000)
    assert nested == {i: 300_000 - 1 - i for i in range(150_000)}


# --- math: format rules, DAPO answers, multiple choice, math-verify's input ----------------


def test_math_format_rules_on_repeated_markup():
    assert has_one_boxed_answer(BOXES) is False
    assert has_one_boxed_answer("\\boxed{" + "{x}" * 100_000 + "}") is True
    assert has_think_answer_format("<think>" * 150_000) is False
    assert has_think_answer_format("<think>" + "</think>\n" * 150_000 + "<answer>4</answer>")
    assert not has_think_answer_format("<think>" + "x" * MB + "</think>\n<answer>4</answer>!")
    assert has_think_answer_format("<think></think>\n<answer>" + "</answer" * 100_000 + "</answer>")


def test_dapo_answer_lines_on_repeated_answers():
    assert extract_dapo_answer("answer" * 150_000) is None
    assert extract_dapo_answer("Answer:" + " " * MB) is None
    assert extract_dapo_answer("Answer:" + "\n" * MB) is None
    assert extract_dapo_answer(" Answer:" * 100_000 + "\nAnswer: 42") == "42"
    assert extract_dapo_answer("Answer: 7\n" + "answer " * 150_000) == "7"
    assert extract_dapo_answer("<think>" * 100_000 + "Answer: 3") is None


def test_dapo_normalisation_on_long_answers():
    assert normalize_final_answer("\\text{" * 50_000) == "\\text{" * 50_000
    assert normalize_final_answer("1" + ",000" * 100_000) == "1" + "000" * 100_000
    assert normalize_final_answer("cm " * 100_000) == ""
    assert grade_dapo("1", "Answer: " + "\\boxed{" * 20_000 + "1" + "}" * 20_000) == (True, "1")


def test_multiple_choice_on_repeated_answer_words():
    assert extract_choice("Answer:" * 150_000) is None
    assert extract_choice("Answer:" * 150_000 + " B") == "B"
    assert extract_choice("Answer" + " " * MB + ": C") == "C"
    assert extract_choice("**" * 500_000 + "Answer: **A**") == "A"
    assert extract_choice("答" * 200_000, multilingual=True) is None
    assert extract_choice("答案：" * 100_000 + "Ｄ", multilingual=True) == "D"


def test_math_verify_input_on_unclosed_boxes():
    assert final_answer_text(BOXES) == BOXES  # no box: the text whole
    thinking = "<think>" + "\\boxed{1}" * 100_000 + "</think>"
    assert final_answer_text(thinking + BOXES + "\\boxed{5}") == "\\boxed{5}"
    assert normalize_answer("1\\," * 300_000 + "000") == "1\\," * 299_999 + "1000"
    assert normalize_answer("Eq(" + "(" * 300_000 + ", 1)") == "Eq(" + "(" * 300_000 + ", 1)"


# --- code: fenced blocks and code tokens ---------------------------------------------------


def test_extract_code_on_unclosed_fences():
    assert extract_code("```python\n" * 100_000) == "\n" * 49_999  # pairs: empty blocks
    assert extract_code("```\n" + "x = 1\n" * 150_000) == "x = 1\n" * 150_000
    assert extract_code("  ```" + "a" * MB) == "  ```" + "a" * MB  # no fence: all of it
    assert extract_code(("  " * 20 + "\n") * 25_000) == ("  " * 20 + "\n") * 25_000


def test_code_tokens_on_unclosed_strings():
    assert code_tokens('\\"' * 150_000) == ["\\", '"'] * 150_000
    assert code_tokens("'" + "\\'" * 100_000) == ["'"] + ["\\", "'"] * 100_000
    assert code_tokens("\\\"\\'" * 100_000 + '\n"ok"') == ["\\", '"', "\\", "'"] * 100_000 + [
        '"ok"'
    ]
    assert code_tokens('"' + "a" * MB) == ['"', "a" * MB]
    assert code_tokens("1" * MB + "e") == ["1" * MB, "e"]
    assert code_jaccard('\\"' * 100_000, 'x\\"') == 2 / 3


# --- games: sliding puzzle moves -----------------------------------------------------------

BOARD = solved_board(3)


def _no_slide(action: str) -> tuple[object, str, bool]:
    """What ``play`` gives for an action that is no move: the board unchanged, and why."""
    return BOARD, f"Invalid move {action[:40]!r}: use up, down, left, right or slide ROW COL.", True


def test_sliding_puzzle_moves_on_long_actions():
    for action in [
        "slide 1 " * 150_000,
        "slide " + "1" * MB + "x",
        "slide " + "1" * MB + " " + "1" * MB + "x",
        "slide 2 " + "0" * 5000 + "3",  # more digits than Python converts: raised ValueError
    ]:
        assert play(BOARD, action) == _no_slide(action)
    assert play(BOARD, " " * MB + "slide 2 3" + "\n" * MB)[1:] == ("Slid 6 down.", False)
    assert extract_tag("<action>up</action>" + "<action>" * 150_000, "action") == "up"


# --- vision: boxes and tags ----------------------------------------------------------------


def test_parse_box_on_long_numbers_and_lists():
    assert parse_box("[" + "1" * MB) is None
    assert parse_box("[1, 2, 3, " * 100_000) is None
    assert parse_box("[1, 2, 3, " * 100_000 + "[0, 0, 4, 4]") == (0.0, 0.0, 4.0, 4.0)
    assert parse_box("[" + " " * MB + "1, 2, 3, 4]") == (1.0, 2.0, 3.0, 4.0)
    assert parse_box("[1" + " " * MB) is None
    assert parse_box("[0." + "0" * MB + "1, 0, 1e" + "1" * MB) is None
    assert parse_box("[0." + "0" * MB + "1, 0, 1, 1]") == (0.0, 0.0, 1.0, 1.0)


def test_vlm_rewards_on_unclosed_tags():
    response = "<answer>" * 150_000 + "[0, 0, 2, 2]"  # no tag pair: the whole response
    assert bbox_giou([response], [[0, 0, 2, 2]]) == [(1.0, True)]
    assert format_reward(["<think>" * 150_000 + "<answer>" * 150_000], [0]) == [(0.0, None)]


# --- differential: the linear parsers agree with the old algorithms -------------------------


def _old_extract_boxed(text: str) -> str | None:
    """From the last ``\\boxed{`` back, the first whose braces balance (rescanning each)."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, open_at = 1, start + len("\\boxed{")
        for i in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[open_at:i]
        start = text.rfind("\\boxed{", 0, start)
    return None


def _old_extract_tag(text: str, tag: str) -> str | None:
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.S)
    return matches[-1].strip() if matches else None


def _old_closing_braces(text: str) -> dict[int, int]:
    """Each ``{`` -> the first ``}`` after it where the braces in between balance."""
    closing = {}
    for open_at in (i for i, ch in enumerate(text) if ch == "{"):
        depth = 0
        for i in range(open_at, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                closing[open_at] = i
                break
    return closing


_OLD_CODE_TOKEN = re.compile(
    r"""
    "(?:\\.|[^"\\\n])*" | '(?:\\.|[^'\\\n])*' | [^\W\d]\w* | 0[xXoObB][0-9a-fA-F_]+
    | \d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)? | \*\*=? | //=? | <<=? | >>=? | \.\.\.
    | [-+*/%&|^=!<>:]= | -> | => | && | \|\| | :: | \+\+ | -- | \S
    """,
    re.X,
)
_OLD_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_OLD_BOX = re.compile(r"\[\s*" + r"\s*,\s*".join([f"({_OLD_NUMBER})"] * 4) + r"\s*\]")
_OLD_SLIDE = re.compile(r"slide\s+(\d+)\s*,?\s*(\d+)")


def _old_parse_box(text: str) -> tuple[float, float, float, float] | None:
    matches = _OLD_BOX.findall(text)
    if not matches:
        return None
    x1, y1, x2, y2 = (float(v) for v in matches[-1])
    return (x1, y1, x2, y2) if x1 < x2 and y1 < y2 else None


def _texts(*tokens: str) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(tokens), max_size=24).map("".join)


@settings(max_examples=200, deadline=None)
@given(_texts("\\boxed{", "\\boxed", "{", "}", "x", " "))
def test_extract_boxed_matches_the_old_algorithm(text):
    assert extract_boxed(text) == _old_extract_boxed(text)
    assert closing_braces(text) == _old_closing_braces(text)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(["a", "", "/a", "a>"]),
    _texts("<a>", "</a>", "<//a>", "<a>>", "</a>>", "<>", "</>", "<", "/", "a", ">", " x "),
)
def test_extract_tag_matches_the_old_regex(tag, text):
    assert extract_tag(text, tag) == _old_extract_tag(text, tag)


@settings(max_examples=200, deadline=None)
@given(_texts('"', "'", "\\", "\n", "\\\n", "a", "1", " ", "=", "**", "."))
def test_code_tokens_match_the_old_regex(code):
    assert code_tokens(code) == _OLD_CODE_TOKEN.findall(code)


@settings(max_examples=200, deadline=None)
@given(_texts("[", "]", ",", ", ", " ", "1", "23", ".", "e", "E", "-", "+", "\n"))
def test_parse_box_matches_the_old_regex(text):
    assert parse_box(text) == _old_parse_box(text)


@settings(max_examples=200, deadline=None)
@given(_texts(" ", "1", "23", "0", ",", " , ", "x", "٣"))
def test_slide_square_matches_the_old_regex(tail):
    text = "slide" + tail
    match = _OLD_SLIDE.fullmatch(text)
    assert _slide_square(text) == (None if match is None else (int(match[1]), int(match[2])))
