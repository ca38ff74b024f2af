"""The demo's synthetic tasks: worked replies are right and wrong replies wrong (checked by
real math-verify), held-out questions never reach training, BFS solutions are shortest, and
the committed demo dataset is what ``demo_rows`` makes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from envloop.demo import tasks
from envloop.environments.common.answer_extraction import extract_boxed
from envloop.environments.common.math_verification import math_equivalent
from envloop.environments.games.sliding_puzzle_board import apply_move, is_solved

DEMO_DATA = Path(__file__).resolve().parents[3] / "examples" / "demo_data.jsonl"


def test_every_worked_reply_boxes_the_value_and_every_wrong_reply_does_not():
    rng = random.Random(0)
    for item in tasks.all_math_items():
        assert extract_boxed(item.response()) == item.ground_truth
        wrong = tasks.wrong_response(item, rng)
        assert extract_boxed(wrong) != item.ground_truth, (item, wrong)
        assert not extract_boxed(wrong).startswith("-")


@pytest.mark.parametrize(
    ("a", "op", "b", "reply"),
    [
        (37, "+", 48, "7 + 8 = 15, 3 + 4 + 1 = 8, so \\boxed{85}"),
        (99, "+", 99, "9 + 9 = 18, 9 + 9 + 1 = 19, so \\boxed{198}"),
        (5, "+", 0, "5 + 0 = 5, 0 + 0 + 0 = 0, so \\boxed{5}"),
        (52, "-", 38, "12 - 8 = 4, 5 - 3 - 1 = 1, so \\boxed{14}"),
        (40, "-", 40, "0 - 0 = 0, 4 - 4 - 0 = 0, so \\boxed{0}"),
    ],
)
def test_worked_replies_are_exact(a, op, b, reply):
    item = tasks.MathItem(a, op, b)
    assert item.response() == reply
    assert math_equivalent((item.ground_truth, reply)) is True


def test_held_out_questions_are_disjoint_from_training_ones():
    held_out, training = tasks.math_items(held_out=True), tasks.math_items(held_out=False)
    assert set(held_out).isdisjoint(training)
    assert len(held_out) + len(training) == len(tasks.all_math_items()) == 10000 + 5050


def test_optimal_moves_solve_the_board_and_are_shortest():
    for seed in range(40):
        episode = tasks.puzzle_episode(seed, 2 + seed % 2, shuffle_moves=5)
        board, moves = episode["board"], tasks.optimal_moves(episode["board"])
        assert len(moves) <= 5
        for move in moves:
            board = apply_move(board, move)
        assert is_solved(board)
        # No shorter solution: dropping any last move leaves the board unsolved.
        if moves:
            board = episode["board"]
            for move in moves[:-1]:
                board = apply_move(board, move)
                assert not is_solved(board)


def test_committed_demo_dataset_is_demo_rows_and_held_out():
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()]
    assert rows == tasks.demo_rows()
    assert [r["task"] for r in rows].count("math") == 12
    questions = {item.question for item in tasks.math_items(held_out=True)}
    assert all(r["prompt"] in questions for r in rows if r["task"] != "sliding_puzzle")
    seeds = [r["metadata"]["seed"] for r in rows if r["task"] == "sliding_puzzle"]
    assert len(seeds) == 6 and min(seeds) >= tasks.HELD_OUT_SEED
