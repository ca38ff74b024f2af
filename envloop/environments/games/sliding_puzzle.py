"""N x N sliding puzzle: the model slides tiles until they read 1 .. N*N-1 with the blank last.

One move per reply, inside ``<action>...</action>``:

- ``up`` / ``down`` / ``left`` / ``right`` name the direction the TILE moves into the blank
  (so the blank moves the opposite way): ``up`` slides the tile below the blank up.
- ``slide R C`` slides the tile at row R, column C (1-based, top-left is ``slide 1 1``)
  into the blank, which must be next to it.

The environment is stateless: each episode lives in its sample's metadata
(:class:`SlidingPuzzleMetadata`), so a restarted Ray actor loses nothing. Every reply counts
as a move, including a missing, malformed or illegal action: the observation explains what
was wrong and shows the unchanged board. A move's reward is ``reward_on_solve`` if it solves
the puzzle, else 0, minus ``move_penalty``; the episode ends when solved or after
``max_moves`` moves. Boards are scrambled from the solved one by random legal moves drawn
from a seeded generator, so they are solvable and the same seed gives the same board.

A reply longer than ``max_parse_chars`` is not parsed at all: the episode ends with reward 0,
the board unchanged, and the reason in the observation and ``metadata["puzzle_error"]``
(``"response has 1,200,000 characters, over max_parse_chars=1,000,000; raise
max_parse_chars to score it"``; counted in ``sliding_puzzle_env/over_max_parse_chars``).
Metadata not made by :func:`new_episode_metadata` (a dataset bug: a missing key, a wrong
type, a board that is not a permutation, even an int too long to print) fails that sample
alone through ``EnvironmentReturn.errors``
(:class:`~envloop.environments.sample_environment.SampleEnvironment`): the rollout records
the error on it and does not train on it, and the other samples play on.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired

from envloop.config import validation
from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.common.answer_extraction import extract_tag
from envloop.environments.games.sliding_puzzle_board import (
    generate,
    is_solved,
    play,
    render,
)
from envloop.environments.games.sliding_puzzle_config import (
    DEFAULT_CONFIG,
    SlidingPuzzleConfig,
    config_problems,
)
from envloop.environments.sample_environment import SampleEnvironment, SampleStep
from envloop.environments.utils import last_assistant_text, parse_cap_reason

__all__ = [
    "DEFAULT_CONFIG",
    "STOP_STRINGS",
    "SlidingPuzzleConfig",
    "SlidingPuzzleEnv",
    "SlidingPuzzleMetadata",
    "initial_prompt",
    "new_episode_metadata",
]

STOP_STRINGS = ["</action>"]


class SlidingPuzzleMetadata(TypedDict):
    """One episode's whole state."""

    board: list[list[int]]  # [N][N] tiles row by row, 0 for the blank
    size: int  # N
    moves_made: int  # replies so far; each counts as a move, legal or not
    invalid_moves: int  # replies whose action was missing, malformed or illegal
    max_moves: int  # the episode ends after this many moves
    seed: int  # the seed the board was scrambled from
    puzzle_error: NotRequired[str]  # why the episode ended unplayed: a reply too long to parse


def new_episode_metadata(
    seed: int, size: int = 3, shuffle_moves: int = 10, max_moves: int = 40
) -> SlidingPuzzleMetadata:
    """A fresh episode: ``generate(size, shuffle_moves, seed)`` with no moves made."""
    if max_moves < 1:
        raise ValueError(f"new_episode_metadata: max_moves must be >= 1, got {max_moves}")
    board = [list(row) for row in generate(size, shuffle_moves, seed)]
    return SlidingPuzzleMetadata(
        board=board, size=size, moves_made=0, invalid_moves=0, max_moves=max_moves, seed=seed
    )


def initial_prompt(metadata: SlidingPuzzleMetadata) -> str:
    """The first user message of an episode: the rules, the move limit and the board."""
    n = metadata["size"]
    return (
        f"Solve this {n}x{n} sliding puzzle: order the tiles 1 to {n * n - 1} row by row "
        "with the blank (_) in the bottom-right corner. Reply with one move per turn inside "
        "<action></action>: up, down, left or right slides the tile next to the blank in "
        "that direction into the blank (up moves the tile below the blank), and slide R C "
        "slides the tile at row R, column C (counted from 1) into the blank. "
        f"You have {metadata['max_moves']} moves.\n{render(metadata['board'])}"
    )


def _metadata_problems(md: Any) -> list[str]:
    if md is None:  # config_problems would read None as "the defaults"; metadata has none
        return ["expected a mapping, got None"]
    try:
        problems = validation.config_problems(SlidingPuzzleMetadata, md)
        if not problems:
            n, rows = md["size"], md["board"]
            square = len(rows) == n and all(isinstance(r, list) and len(r) == n for r in rows)
            if not square or sorted(t for r in rows for t in r) != list(range(n * n)):
                problems.append(f"board: expected {n} lists of {n} tiles holding 0..{n * n - 1}")
    except Exception as exc:  # a value that cannot even be printed (an int past 4,300 digits)
        problems = [f"{type(exc).__name__}: {exc}"]
    return problems


def _count(moves: int) -> str:
    return f"{moves} move{'s' * (moves != 1)}"


class SlidingPuzzleEnv(SampleEnvironment[SlidingPuzzleMetadata]):
    """Plays one move per sample per ``step``; see the module docstring for the rules.
    Rewards [B] float32, terminateds [B] bool; observations come as the user."""

    observation_role = "user"

    def __init__(self, config: SlidingPuzzleConfig | None = None) -> None:
        problems = self.config_problems(config)
        if problems:
            raise ConfigError("sliding_puzzle config", problems)
        self.config = SlidingPuzzleConfig(**{**DEFAULT_CONFIG, **(config or {})})

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (:func:`.sliding_puzzle_config.config_problems`)."""
        return config_problems(config)

    def new_episode_metadata(self, seed: int) -> SlidingPuzzleMetadata:
        """A fresh episode with this config's default size, scramble length and move limit."""
        c = self.config
        return new_episode_metadata(
            seed, c["default_size"], c["default_shuffle_moves"], c["default_max_moves"]
        )

    def step_sample(self, messages: list[Any], metadata: Any) -> SampleStep:
        """Play the sample's last reply on its board; ``answer`` is the reply's action text
        (None when absent). Metadata not made by :func:`new_episode_metadata` (a dataset
        bug) raises ConfigError, which fails this sample; a reply over ``max_parse_chars``
        ends the episode unplayed."""
        md, response = metadata, last_assistant_text(messages)
        problems = _metadata_problems(md)
        if problems:
            raise ConfigError(
                "sliding_puzzle episode metadata (use new_episode_metadata)", problems
            )
        too_long = parse_cap_reason("response", len(response), self.config["max_parse_chars"])
        if too_long:
            return self._unplayed(md, too_long)
        action = extract_tag(response, "action")
        board, status, invalid = play(tuple(map(tuple, md["board"])), action)
        moves = md["moves_made"] + 1
        new_md = SlidingPuzzleMetadata(
            board=[list(row) for row in board], size=md["size"], moves_made=moves,
            invalid_moves=md["invalid_moves"] + invalid, max_moves=md["max_moves"], seed=md["seed"],
        )  # fmt: skip
        solved, left = is_solved(board), md["max_moves"] - moves
        if solved:
            status += f" Solved in {_count(moves)}!"
        elif left <= 0:
            status += f" Move limit of {md['max_moves']} reached; the puzzle is unsolved."
        else:
            status += f" {_count(left)} left."
        done = solved or left <= 0
        reward = (self.config["reward_on_solve"] if solved else 0.0) - self.config["move_penalty"]
        observation = f"{status}\n{render(board, show_moves=not done)}"
        return SampleStep(observation, reward, done, metadata=new_md,
                          next_stop_strings=list(STOP_STRINGS), answer=action)  # fmt: skip

    def _unplayed(self, metadata: Any, why: str) -> SampleStep:
        """The episode ends without a move: reward 0, ``why`` in the observation and in
        ``metadata["puzzle_error"]``."""
        text = f"Not played, so the episode ends with reward 0: {why}."
        return SampleStep(text, 0.0, True, metadata={**metadata, "puzzle_error": why})

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, Any]]:
        """Metrics over the batch's final episode states (``extra_env_info``; the metadata
        of a sample that failed, not an episode's, is left out) and the count of final
        replies over ``max_parse_chars``."""
        infos = batch["extra_env_info"]
        episodes = [md for md in infos if md is not None and not _metadata_problems(md)]
        count, moves = max(len(episodes), 1), sum(md["moves_made"] for md in episodes)
        replies = [last_assistant_text(log) for log in batch.get("message_log") or []]
        cap = self.config["max_parse_chars"]
        solved = [is_solved(md["board"]) for md in episodes]
        limit = [not s and md["moves_made"] >= md["max_moves"] for s, md in zip(solved, episodes)]
        return batch, {
            "sliding_puzzle_env/num_episodes": len(episodes),
            "sliding_puzzle_env/solve_rate": sum(solved) / count,
            "sliding_puzzle_env/mean_moves": moves / count,
            "sliding_puzzle_env/invalid_move_rate": (
                sum(md["invalid_moves"] for md in episodes) / max(moves, 1)
            ),
            "sliding_puzzle_env/move_limit_rate": sum(limit) / count,
            "sliding_puzzle_env/over_max_parse_chars": sum(len(r) > cap for r in replies),
        }
