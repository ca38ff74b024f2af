"""Answer parsing on adversarial model output: the time each parser the built-in
environments run on a response takes on 10 KB, 100 KB and 1 MB of repetitive, adversarial
text (unclosed boxes, tags, fences and strings, long runs of digits), against plain text of
the same size, side by side in one run.

Each parser is called as its environment calls it. The adversarial input repeats a pattern
that made the previous parsers quadratic (an unclosed opening searched again from each
occurrence, a run of digits split at each position) or would make a naive one so; the plain
input is ordinary reasoning text (code, for the code parsers) ending in one well-formed
answer. A linear parser keeps its ratio to plain text about the same as the size grows
100-fold (text dense in braces or tokens costs more per character than prose, hence ratios
above 1); a quadratic one's ratio grows about 100-fold too. The replaced ``extract_boxed``
took 7.5 s on 28 KB of ``\\boxed{`` (and would take about 3 hours on 1 MB). Times are per
call, the best of ``--repeats`` timings.

    .venv/bin/python benchmarks/adversarial_parsing.py [--sizes 10000 100000 1000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop.environments.code.similarity import code_tokens, extract_code
from envloop.environments.common.answer_extraction import extract_boxed, extract_tag
from envloop.environments.common.math_verification import final_answer_text
from envloop.environments.games.sliding_puzzle_board import play, solved_board
from envloop.environments.math.checks import has_one_boxed_answer, has_think_answer_format
from envloop.environments.math.dapo_answers import grade_dapo
from envloop.environments.math.multichoice_answers import extract_choice
from envloop.environments.rewards import bbox_giou, parse_box

PROSE = "Let me think step by step: 3 apples and 4 pears make 7 fruits in total. "
CODE = "def area(w, h):\n    return w * h  # the 'area' of a box\n"


class Case(NamedTuple):
    parser: str
    run: Callable[[str], Any]
    pattern: str
    """Repeated to fill the adversarial input."""
    prefix: str = ""
    """What the adversarial input starts with (then the pattern, repeated)."""
    suffix: str = ""
    """What the adversarial input ends with."""
    benign: str = PROSE
    answer: str = ""
    """Ends the benign input."""


CASES = [
    Case("extract_boxed", extract_boxed, "\\boxed{", answer="\\boxed{7}"),
    Case(
        "extract_tag (code env)",
        lambda t: extract_tag(t, "code"),
        "<code>",
        answer="<code>x</code>",
    ),
    Case("has_one_boxed_answer", has_one_boxed_answer, "{", "\\boxed{", answer="\\boxed{7}"),
    Case(
        "has_think_answer_format",
        has_think_answer_format,
        "</think>\n",
        "<think>",
        answer="<answer>7</answer>",
    ),
    Case("grade_dapo", lambda t: grade_dapo("7", t), "\\text{", "Answer: ", answer="\nAnswer: 7"),
    Case(
        "extract_choice (multilingual)",
        lambda t: extract_choice(t, True),
        "答案：",
        answer="Answer: B",
    ),
    Case(
        "final_answer_text (math-verify input)", final_answer_text, "\\boxed{", answer="\\boxed{7}"
    ),
    Case("extract_code", extract_code, "```python\n", benign=CODE, answer="```\nx = 1\n```"),
    Case("code_tokens", code_tokens, '\\"', benign=CODE),
    Case(
        "sliding puzzle play",
        lambda t: play(solved_board(3), t),
        "1",
        "slide ",
        "x",
        answer="slide 2 3",
    ),
    Case("parse_box", parse_box, "1", "[", answer="[0, 0, 2, 2]"),
    Case(
        "bbox_giou (vlm)",
        lambda t: bbox_giou([t], [[0, 0, 2, 2]]),
        "<answer>",
        answer="[0, 0, 2, 2]",
    ),
]


def filled(prefix: str, pattern: str, size: int, suffix: str = "") -> str:
    """``prefix``, then ``pattern`` repeated, then ``suffix``: ``size`` characters in all."""
    body = size - len(prefix) - len(suffix)
    return prefix + (pattern * (body // len(pattern) + 1))[:body] + suffix


def best_time(run: Callable[[str], Any], text: str, repeats: int) -> float:
    """Seconds per call: the best of ``repeats`` timings, each of enough calls to last."""
    calls = max(1, 100_000 // len(text))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run(text)
        times.append((time.perf_counter() - start) / calls)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    command = " ".join(["benchmarks/adversarial_parsing.py", *sys.argv[1:]])
    print(
        f"`.venv/bin/python {command}` ({os.cpu_count()} CPUs, load average before: "
        f"{os.getloadavg()[0]:.2f}); best of {args.repeats}, seconds (x plain text)\n"
    )
    print("| parser | adversarial input | " + " | ".join(_size(s) for s in args.sizes) + " |")
    print("|---|---|" + "---:|" * len(args.sizes))
    for case in CASES:
        cells = []
        for size in args.sizes:
            attack = best_time(
                case.run, filled(case.prefix, case.pattern, size, case.suffix), args.repeats
            )
            plain = filled("", case.benign, size, case.answer)
            cells.append(f"{attack:.6f} ({attack / best_time(case.run, plain, args.repeats):.1f}x)")
        print(f"| {case.parser} | `{_shown(case)}` | " + " | ".join(cells) + " |")
    print(f"\n(load average after: {os.getloadavg()[0]:.2f})")


def _shown(case: Case) -> str:
    parts = [repr(case.prefix), f"{case.pattern!r} * n", repr(case.suffix)]
    return " + ".join(p for p in parts if p != "''")


def _size(size: int) -> str:
    return f"{size / 1e6:g} MB" if size >= 1_000_000 else f"{size / 1e3:g} KB"


if __name__ == "__main__":
    main()
