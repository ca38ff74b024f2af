"""Sliding-puzzle board logic: pure functions on an N x N board (0 is the blank).

Directions name the way the TILE moves into the blank (``up`` slides the tile below the
blank up); ``slide R C`` (1-based) slides the tile at row R, column C into the adjacent blank.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

Board = tuple[tuple[int, ...], ...]
"""[N][N] tiles, row by row; 0 is the blank."""

DIRECTIONS = ("up", "down", "left", "right")
_TILE_AT = {"up": (1, 0), "down": (-1, 0), "left": (0, 1), "right": (0, -1)}
"""Where the tile that moves in each direction sits, relative to the blank."""
_WHERE = {"up": "below", "down": "above", "left": "to the right of", "right": "to the left of"}
_OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
_SLIDE = re.compile(r"slide\s++(\d++)(?:\s*+,?\s*+(\d++))?")
"""``slide R C``, possessive: a run of digits is read once, never split at each of its digits."""
NO_ACTION = (
    "No move found: reply with one move, e.g. <action>up</action> or <action>slide 2 3</action>."
)


class IllegalMoveError(ValueError):
    """A move that cannot be played on the board; the message says why."""


def solved_board(size: int) -> Board:
    """Tiles 1 .. N*N-1 row by row, the blank last.

    >>> solved_board(2)
    ((1, 2), (3, 0))
    """
    tiles = [*range(1, size * size), 0]
    return tuple(tuple(tiles[r * size : (r + 1) * size]) for r in range(size))


def is_solved(board: Sequence[Sequence[int]]) -> bool:
    return tuple(map(tuple, board)) == solved_board(len(board))


def blank_of(board: Sequence[Sequence[int]]) -> tuple[int, int]:
    """0-based (row, column) of the blank."""
    return next((r, c) for r, row in enumerate(board) for c, t in enumerate(row) if t == 0)


def legal_moves(board: Sequence[Sequence[int]]) -> list[str]:
    """The directions a tile can move into the blank, in ``DIRECTIONS`` order.

    >>> legal_moves(((1, 2), (3, 0)))
    ['down', 'right']
    """
    (r, c), n = blank_of(board), len(board)
    return [d for d, (dr, dc) in _TILE_AT.items() if 0 <= r + dr < n and 0 <= c + dc < n]


def parse_move(board: Sequence[Sequence[int]], action: str) -> str:
    """The direction ``action`` (a direction or ``slide R C``) moves a tile on ``board``;
    raises :class:`IllegalMoveError` saying why it cannot be played.

    >>> parse_move(((1, 2), (3, 0)), "Slide 1 2")
    'down'
    """
    text, shown = " ".join(action.lower().split()), repr(action[:40])
    if text in DIRECTIONS:
        if text in legal_moves(board):
            return text
        raise IllegalMoveError(f"Invalid move {shown}: no tile {_WHERE[text]} the blank.")
    square = _slide_square(text)
    if square is None:
        raise IllegalMoveError(f"Invalid move {shown}: use up, down, left, right or slide ROW COL.")
    (row, col), n, (br, bc) = square, len(board), blank_of(board)
    if not (1 <= row <= n and 1 <= col <= n):
        raise IllegalMoveError(f"Invalid move {shown}: row {row}, column {col} is off the board.")
    for direction, (dr, dc) in _TILE_AT.items():
        if (br + dr + 1, bc + dc + 1) == (row, col):
            return direction
    where = "the blank" if (row, col) == (br + 1, bc + 1) else "not next to the blank"
    raise IllegalMoveError(f"Invalid move {shown}: row {row}, column {col} is {where}.")


def _slide_square(text: str) -> tuple[int, int] | None:
    """(row, column) of a ``slide R C`` move; one run of digits is split before its last
    digit (``slide 12`` is row 1, column 2); None when ``text`` is no slide.

    >>> _slide_square("slide 2, 3"), _slide_square("slide 123"), _slide_square("slide 1")
    ((2, 3), (12, 3), None)
    """
    match = _SLIDE.fullmatch(text)
    if match is None:
        return None
    row, col = (match[1], match[2]) if match[2] else (match[1][:-1], match[1][-1])
    if not row:  # "slide 1": one digit, no column
        return None
    try:
        return int(row), int(col)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits())
        return None


def apply_move(board: Sequence[Sequence[int]], move: str) -> Board:
    """``board`` after ``move`` (a direction or ``slide R C``); IllegalMoveError if impossible.

    >>> apply_move(((1, 2), (3, 0)), "down")
    ((1, 0), (3, 2))
    """
    (r, c), (dr, dc) = blank_of(board), _TILE_AT[parse_move(board, move)]
    rows = [list(row) for row in board]
    rows[r][c], rows[r + dr][c + dc] = rows[r + dr][c + dc], 0
    return tuple(map(tuple, rows))


def generate(size: int, shuffle_moves: int, seed: int) -> Board:
    """The solved board after ``shuffle_moves`` random legal moves, never undoing the previous
    one (plus one more if that came back to solved, so ``shuffle_moves >= 1`` never gives a
    solved board). The same arguments always give the same board."""
    if size < 2 or shuffle_moves < 0:
        raise ValueError(
            f"generate: need size >= 2 and shuffle_moves >= 0, got {size}, {shuffle_moves}"
        )
    rng, board, last, made = random.Random(seed), solved_board(size), "", 0
    while made < shuffle_moves or (shuffle_moves and is_solved(board)):
        last = rng.choice([m for m in legal_moves(board) if m != _OPPOSITE.get(last)])
        board, made = apply_move(board, last), made + 1
    return board


def render(board: Sequence[Sequence[int]], show_moves: bool = True) -> str:
    """The board as the model sees it, ``_`` for the blank.

    >>> print(render(((1, 2), (3, 0))))
    1 2
    3 _
    Legal moves: down, right
    """
    width = len(str(len(board) ** 2 - 1))
    lines = [" ".join(str(t or "_").rjust(width) for t in row) for row in board]
    return "\n".join(lines + ([f"Legal moves: {', '.join(legal_moves(board))}"] * show_moves))


def play(board: Board, action: str | None) -> tuple[Board, str, bool]:
    """The board after ``action`` (None: the reply had no action), a sentence saying what
    happened, and whether the action was invalid (the board is then unchanged).

    >>> play(((1, 2), (3, 0)), "right")
    (((1, 2), (0, 3)), 'Slid 3 right.', False)
    """
    try:
        if action is None:
            raise IllegalMoveError(NO_ACTION)
        (r, c), direction = blank_of(board), parse_move(board, action)
        moved = apply_move(board, direction)
        return moved, f"Slid {moved[r][c]} {direction}.", False
    except IllegalMoveError as exc:
        return board, str(exc), True
