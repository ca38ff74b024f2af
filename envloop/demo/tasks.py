"""The demo's synthetic tasks, in the exact formats the bundled models were trained on.

- **Arithmetic**: ``What is 37 + 48?`` with operands 0..99 (a difference is never negative),
  worked column by column: ``7 + 8 = 15, 3 + 4 + 1 = 8, so \\boxed{85}``. A fixed tenth
  of the questions (:func:`is_held_out`) never appears in training; tests and the demo
  dataset draw from it.
- **Retries and reward pairs**: :func:`wrong_response` gives replies with one slip (a
  column off by one, a wrong boxed number) that precede ``Environment: incorrect`` in
  training conversations and that the reward model learns to score below the right reply.
- **Sliding puzzles**: episodes of the sliding-puzzle environment's
  ``new_episode_metadata``, played by :func:`optimal_moves` (breadth-first search). Seeds
  below :data:`HELD_OUT_SEED` are for training, seeds from it on are held out.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from envloop.environments.games.sliding_puzzle import (
    SlidingPuzzleMetadata,
    initial_prompt,
    new_episode_metadata,
)
from envloop.environments.games.sliding_puzzle_board import (
    DIRECTIONS,
    Board,
    apply_move,
    legal_moves,
    solved_board,
)

MAX_OPERAND = 99
HELD_OUT_SEED = 1_000_000
PUZZLE_MAX_MOVES = {2: 8, 3: 10}
"""Puzzle size -> the move limit of the demo's episodes."""
PUZZLE_SHUFFLES = (3, 4, 5)
"""Scramble lengths of the demo's episodes (an optimal solution is as long, at these sizes)."""


@dataclass(frozen=True)
class MathItem:
    """One question ``a op b`` (``op`` is ``+`` or ``-``), answered column by column.

    The reply works the units column, then the tens column with the carry (or borrow), then
    boxes the result; a tiny model learns that far faster than whole-number sums.

    >>> item = MathItem(37, "+", 48)
    >>> item.question, item.ground_truth
    ('What is 37 + 48?', '85')
    >>> item.response()
    '7 + 8 = 15, 3 + 4 + 1 = 8, so \\\\boxed{85}'
    >>> MathItem(52, "-", 38).response()
    '12 - 8 = 4, 5 - 3 - 1 = 1, so \\\\boxed{14}'
    """

    a: int
    op: str
    b: int

    @property
    def value(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def ground_truth(self) -> str:
        return str(self.value)

    def response(self, units_slip: int = 0, tens_slip: int = 0, answer: int | None = None) -> str:
        """The worked reply; a slip adds to a column's written result (later steps follow
        from the slipped one), ``answer`` overrides the boxed number."""
        (a1, a0), (b1, b0) = divmod(self.a, 10), divmod(self.b, 10)
        if self.op == "+":
            units = a0 + b0 + units_slip
            carry = units // 10
            tens = a1 + b1 + carry + tens_slip
            steps = f"{a0} + {b0} = {units}, {a1} + {b1} + {carry} = {tens}"
        else:
            borrow = int(a0 < b0)
            units = a0 + 10 * borrow - b0 + units_slip
            tens = a1 - b1 - borrow + tens_slip
            steps = f"{a0 + 10 * borrow} - {b0} = {units}, {a1} - {b1} - {borrow} = {tens}"
        boxed = 10 * tens + units % 10 if answer is None else answer
        return f"{steps}, so \\boxed{{{boxed}}}"


def is_held_out(item: MathItem) -> bool:
    """Whether ``item`` belongs to the held-out tenth (a fixed hash of its text).

    >>> sum(is_held_out(i) for i in all_math_items()) / len(all_math_items())
    0.0986...
    """
    return zlib.crc32(item.question.encode()) % 10 == 0


@functools.lru_cache(maxsize=1)
def all_math_items() -> tuple[MathItem, ...]:
    """Every question: all sums, and all differences that are not negative."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    sums = [MathItem(a, "+", b) for a, b in pairs]
    return tuple(sums + [MathItem(a, "-", b) for a, b in pairs if a >= b])


def math_items(held_out: bool) -> list[MathItem]:
    """The training (``held_out=False``) or held-out questions, in a fixed order."""
    return [item for item in all_math_items() if is_held_out(item) == held_out]


def wrong_answer(item: MathItem, rng: random.Random) -> int:
    """A plausible wrong number for ``item``: off by 1 or 2, a carry slip (10), the other
    operation, or a random number; never negative, never right."""
    value = item.value
    candidates = [value + d for d in (-2, -1, 1, 2, -10, 10, -11, 11, -9, 9)]
    swapped = item.a - item.b if item.op == "+" else item.a + item.b
    candidates += [swapped, rng.randint(0, 2 * MAX_OPERAND)]
    return rng.choice([c for c in candidates if c >= 0 and c != value])


def wrong_response(item: MathItem, rng: random.Random) -> str:
    """A worked reply with one mistake: a wrong boxed number after right steps, or a
    units or tens column off by one (and the answer that follows from it).

    >>> wrong_response(MathItem(37, "+", 48), random.Random(0))
    '7 + 8 = 16, 3 + 4 + 1 = 8, so \\\\boxed{86}'
    """
    kind = rng.choice(["answer", "units", "tens"])
    slip = rng.choice([-1, 1])
    if kind == "answer":
        return item.response(answer=wrong_answer(item, rng))
    response = item.response(units_slip=slip) if kind == "units" else item.response(tens_slip=slip)
    if "{-" in response or "= -" in response or response == item.response():
        return item.response(answer=wrong_answer(item, rng))  # no valid slip here
    return response


def puzzle_episode(
    seed: int, size: int, shuffle_moves: int, max_moves: int | None = None
) -> SlidingPuzzleMetadata:
    """An episode of ``size``, with the demo's move limit unless ``max_moves`` is given."""
    return new_episode_metadata(seed, size, shuffle_moves, max_moves or PUZZLE_MAX_MOVES[size])


def optimal_moves(board: Board) -> tuple[str, ...]:
    """A shortest solution of ``board``: of all shortest ones, the first in ``DIRECTIONS``
    order, so the first move is a function of the board alone.

    >>> optimal_moves(((1, 2), (0, 3)))
    ('left',)
    >>> optimal_moves(((1, 2, 3), (4, 5, 6), (7, 8, 0)))
    ()
    """
    return _optimal_moves(tuple(map(tuple, board)))


@functools.lru_cache(maxsize=65536)
def _optimal_moves(start: Board) -> tuple[str, ...]:
    goal, parents = solved_board(len(start)), {start: ("", start)}
    queue = deque([start])
    while queue:
        board = queue.popleft()
        if board == goal:
            break
        for move in (m for m in DIRECTIONS if m in legal_moves(board)):
            nxt = apply_move(board, move)
            if nxt not in parents:
                parents[nxt] = (move, board)
                queue.append(nxt)
    moves, board = [], goal
    while board != start:
        move, board = parents[board]
        moves.append(move)
    return tuple(reversed(moves))


def demo_rows(
    num_math: int = 12, num_puzzles: int = 6, num_reward: int = 6, seed: int = 0
) -> list[dict[str, Any]]:
    """The demo dataset's rows, all held out from training: ``math`` questions (ground truth
    the answer), ``sliding_puzzle`` episodes (``metadata`` the episode; 2x2 and 3x3 in turn,
    scrambled by each of :data:`PUZZLE_SHUFFLES`) and ``reward_model`` questions, whose
    replies the reward model scores."""
    rng = random.Random(seed)
    questions = rng.sample(math_items(held_out=True), num_math + num_reward)
    rows: list[dict[str, Any]] = [
        {"task": "math", "prompt": q.question, "ground_truth": q.ground_truth}
        for q in questions[:num_math]
    ]
    for i in range(num_puzzles):
        shuffle = PUZZLE_SHUFFLES[(i // 2) % len(PUZZLE_SHUFFLES)]
        episode = puzzle_episode(HELD_OUT_SEED + i, 2 + i % 2, shuffle)
        rows.append(
            {"task": "sliding_puzzle", "prompt": initial_prompt(episode), "metadata": episode}
        )
    rows += [
        {"task": "reward_model", "prompt": q.question, "ground_truth": q.ground_truth}
        for q in questions[num_math:]
    ]
    return rows
