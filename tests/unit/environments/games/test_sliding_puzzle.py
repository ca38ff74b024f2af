"""The sliding puzzle: exact boards and explanations, whole episodes, and solved rollouts."""

from __future__ import annotations

from functools import cache

import pytest

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments import check_env
from envloop.environments.games.sliding_puzzle import (
    DEFAULT_CONFIG,
    SlidingPuzzleEnv,
    initial_prompt,
    new_episode_metadata,
)
from envloop.environments.games.sliding_puzzle_board import (
    IllegalMoveError,
    apply_move,
    generate,
    is_solved,
    parse_move,
    render,
    solved_board,
)
from envloop.environments.registry import create_env, register_env
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch

CENTER = ((1, 2, 3), (4, 0, 5), (7, 8, 6))
CORNER, TOP_LEFT = ((1, 2), (3, 0)), ((0, 1), (2, 3))
NEARLY = [[1, 2, 3], [4, 5, 6], [0, 7, 8]]  # solved by left, left
NO_ACTION = (
    "No move found: reply with one move, e.g. <action>up</action> or <action>slide 2 3</action>."
)


# An independent solver: BFS distances to the solved board over flat states.
def _neighbours(state: tuple[int, ...], n: int):
    i = state.index(0)
    r, c = divmod(i, n)
    for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
        if 0 <= rr < n and 0 <= cc < n:
            s = list(state)
            s[i], s[rr * n + cc] = s[rr * n + cc], 0
            yield (rr, cc), tuple(s)


@cache
def distances(n: int) -> dict[tuple[int, ...], int]:
    start = (*range(1, n * n), 0)
    dist, frontier = {start: 0}, [start]
    while frontier:
        nxt = []
        for state in frontier:
            for _, nb in _neighbours(state, n):
                if nb not in dist:
                    dist[nb] = dist[state] + 1
                    nxt.append(nb)
        frontier = nxt
    return dist


def distance(board) -> int | None:
    return distances(len(board)).get(tuple(t for row in board for t in row))


def last_board(text: str) -> tuple[tuple[int, ...], ...]:
    """The last board rendered in ``text`` (the N lines before the last 'Legal moves:')."""
    lines = text[: text.rindex("Legal moves:")].rstrip("\n").split("\n")
    n = len(lines[-1].split())
    return tuple(tuple(0 if t == "_" else int(t) for t in line.split()) for line in lines[-n:])


def solver_reply(prompt_text: str) -> str:
    """An optimal move for the latest board: a direction on even turns, ``slide R C`` on odd
    ones; the first turn adds text around the action (no stop string cuts it yet)."""
    board = last_board(prompt_text)
    n, turn = len(board), prompt_text.count("Legal moves:") - 1
    flat = tuple(t for row in board for t in row)
    (r, c), words = divmod(flat.index(0), n), {(1, 0): "up", (-1, 0): "down", (0, 1): "left"}
    for (rr, cc), nb in _neighbours(flat, n):
        if distances(n)[nb] == distances(n)[flat] - 1:
            move = (
                words.get((rr - r, cc - c), "right")
                if turn % 2 == 0
                else f"slide {rr + 1} {cc + 1}"
            )
            return (
                f"Thinking. <action>{move}</action> Done."
                if turn == 0
                else f"<action>{move}</action>"
            )
    raise AssertionError(f"no improving move on {board}")


def episode(board, max_moves: int = 5, moves_made: int = 0, invalid_moves: int = 0) -> dict:
    board = [list(row) for row in board]
    return {"board": board, "size": len(board), "moves_made": moves_made,
            "invalid_moves": invalid_moves, "max_moves": max_moves, "seed": 0}  # fmt: skip


def reply(env, md, text: str):
    ret = env.step(
        [[{"role": "user", "content": "go"}, {"role": "assistant", "content": text}]], [md]
    )
    return (
        ret.observations[0]["content"],
        ret.metadata[0],
        ret.rewards.item(),
        ret.terminateds.item(),
    )


# --- game logic -------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed():
    assert [generate(3, 20, s) for s in range(10)] == [generate(3, 20, s) for s in range(10)]
    assert generate(3, 20, 0) == ((1, 3, 2), (5, 8, 7), (6, 4, 0))
    assert generate(3, 20, 1) == ((7, 4, 1), (8, 2, 5), (3, 6, 0))
    assert len({generate(3, 20, s) for s in range(10)}) == 10
    assert generate(3, 0, 5) == solved_board(3) == ((1, 2, 3), (4, 5, 6), (7, 8, 0))


@pytest.mark.parametrize("size", [2, 3])
def test_generated_boards_are_solvable_and_never_solved(size):
    for shuffle in range(1, 15):
        for seed in range(10):
            board = generate(size, shuffle, seed)
            assert sorted(t for row in board for t in row) == list(range(size * size))
            assert 1 <= distance(board) <= shuffle + 1, (size, shuffle, seed)


def test_a_scramble_that_returns_to_solved_takes_one_more_move():
    # On 2x2 the blank can only circle; 12 non-undoing moves come back to solved.
    assert distance(generate(2, 12, 0)) == 1 and generate(2, 12, 0) == ((1, 2), (0, 3))
    with pytest.raises(ValueError, match="size >= 2"):
        generate(1, 3, 0)


@pytest.mark.parametrize(
    ("move", "expected"),
    [
        ("up", ((1, 2, 3), (4, 8, 5), (7, 0, 6))),  # the tile below the blank moves up
        ("down", ((1, 0, 3), (4, 2, 5), (7, 8, 6))),
        ("left", ((1, 2, 3), (4, 5, 0), (7, 8, 6))),
        ("right", ((1, 2, 3), (0, 4, 5), (7, 8, 6))),
        ("slide 3 2", ((1, 2, 3), (4, 8, 5), (7, 0, 6))),
        ("slide 1 2", ((1, 0, 3), (4, 2, 5), (7, 8, 6))),
        ("slide 2 3", ((1, 2, 3), (4, 5, 0), (7, 8, 6))),
        ("SLIDE 2, 1", ((1, 2, 3), (0, 4, 5), (7, 8, 6))),
        (" Up ", ((1, 2, 3), (4, 8, 5), (7, 0, 6))),
    ],
)
def test_apply_move_exact_boards(move, expected):
    assert apply_move(CENTER, move) == expected
    assert apply_move([list(row) for row in CENTER], move) == expected


@pytest.mark.parametrize(
    ("board", "move", "why"),
    [
        (CORNER, "up", "Invalid move 'up': no tile below the blank."),
        (CORNER, "left", "Invalid move 'left': no tile to the right of the blank."),
        (TOP_LEFT, "down", "Invalid move 'down': no tile above the blank."),
        (TOP_LEFT, "right", "Invalid move 'right': no tile to the left of the blank."),
        (CORNER, "slide 3 1", "Invalid move 'slide 3 1': row 3, column 1 is off the board."),
        (CORNER, "slide 0 1", "Invalid move 'slide 0 1': row 0, column 1 is off the board."),
        (
            CORNER,
            "slide 1 1",
            "Invalid move 'slide 1 1': row 1, column 1 is not next to the blank.",
        ),
        (CORNER, "slide 2 2", "Invalid move 'slide 2 2': row 2, column 2 is the blank."),
        (CORNER, "jump", "Invalid move 'jump': use up, down, left, right or slide ROW COL."),
    ],
)
def test_illegal_moves_are_explained_exactly(board, move, why):
    with pytest.raises(IllegalMoveError) as info:
        apply_move(board, move)
    assert str(info.value) == why
    with pytest.raises(IllegalMoveError):
        parse_move(board, move)


def test_render_and_prompt():
    assert render(((3, 6, 0, 4), (1, 2, 11, 7), (10, 14, 9, 8), (5, 13, 15, 12))) == (
        " 3  6  _  4\n 1  2 11  7\n10 14  9  8\n 5 13 15 12\nLegal moves: up, left, right"
    )
    md = new_episode_metadata(0, size=2, shuffle_moves=3, max_moves=5)
    assert md == episode([[2, 0], [1, 3]], max_moves=5)
    assert initial_prompt(md) == (
        "Solve this 2x2 sliding puzzle: order the tiles 1 to 3 row by row with the blank (_) in "
        "the bottom-right corner. Reply with one move per turn inside <action></action>: up, "
        "down, left or right slides the tile next to the blank in that direction into the blank "
        "(up moves the tile below the blank), and slide R C slides the tile at row R, column C "
        "(counted from 1) into the blank. You have 5 moves.\n2 _\n1 3\nLegal moves: up, right"
    )
    assert last_board(initial_prompt(md)) == ((2, 0), (1, 3))


# --- the environment --------------------------------------------------------------------


def test_solving_sequence_rewards_once_at_the_solving_move():
    env = SlidingPuzzleEnv()
    obs, md, reward, done = reply(env, episode(NEARLY), "<action>left</action>")
    assert obs == "Slid 7 left. 4 moves left.\n1 2 3\n4 5 6\n7 _ 8\nLegal moves: down, left, right"
    assert (reward, done, md["moves_made"], md["board"]) == (
        0.0,
        False,
        1,
        [[1, 2, 3], [4, 5, 6], [7, 0, 8]],
    )
    obs, md, reward, done = reply(env, md, "ok <action>slide 3 3</action>")
    assert obs == "Slid 8 left. Solved in 2 moves!\n1 2 3\n4 5 6\n7 8 _"
    assert (reward, done) == (1.0, True)
    assert md == {**episode(solved_board(3)), "moves_made": 2}


def test_move_limit_ends_the_episode_unsolved():
    env = SlidingPuzzleEnv()
    obs, md, reward, done = reply(env, episode(NEARLY, max_moves=2), "<action>down</action>")
    assert obs == "Slid 4 down. 1 move left.\n1 2 3\n_ 5 6\n4 7 8\nLegal moves: up, down, left"
    assert (reward, done, md["board"]) == (0.0, False, [[1, 2, 3], [0, 5, 6], [4, 7, 8]])
    obs, md, reward, done = reply(env, md, "<action>up</action>")
    assert obs == "Slid 4 up. Move limit of 2 reached; the puzzle is unsolved.\n1 2 3\n4 5 6\n_ 7 8"
    assert (reward, done, md["moves_made"]) == (0.0, True, 2)


def test_malformed_and_illegal_replies_are_explained_and_count_as_moves():
    env = SlidingPuzzleEnv()
    start = episode([[2, 0], [1, 3]])
    obs, md, reward, done = reply(env, start, "I think up")
    assert obs == f"{NO_ACTION} 4 moves left.\n2 _\n1 3\nLegal moves: up, right"
    assert (reward, done, md["moves_made"], md["invalid_moves"]) == (0.0, False, 1, 1)
    obs, md, reward, done = reply(env, md, "<action>left</action>")
    assert obs == (
        "Invalid move 'left': no tile to the right of the blank. 3 moves left.\n"
        "2 _\n1 3\nLegal moves: up, right"
    )
    assert (md["board"], md["moves_made"], md["invalid_moves"]) == ([[2, 0], [1, 3]], 2, 2)
    ret = env.step([[{"role": "assistant", "content": "<action></action>"}]], [start])
    assert ret.observations[0]["content"].startswith("Invalid move '': use up, down, left")
    assert ret.answers == [""] and ret.next_stop_strings == [["</action>"]]


def test_move_penalty_and_reward_on_solve():
    env = SlidingPuzzleEnv({"move_penalty": 0.25, "reward_on_solve": 2.0})
    _, md, first, _ = reply(env, episode(NEARLY), "<action>left</action>")
    _, _, second, done = reply(env, md, "<action>left</action>")
    assert (first, second, done) == (-0.25, 1.75, True)


def test_config_errors_name_every_bad_key():
    with pytest.raises(ConfigError) as info:
        SlidingPuzzleEnv(
            {"default_sise": 3, "default_size": 1, "reward_on_solve": "1", "move_penalty": -0.5}
        )
    assert info.value.problems == [
        "default_size: must be >= 2, got 1",
        "reward_on_solve: expected number, got str ('1')",
        "move_penalty: must be >= 0, got -0.5",
        "default_sise: unknown option. Did you mean 'default_size'?",
    ]
    env = SlidingPuzzleEnv(None)
    assert env.config == DEFAULT_CONFIG
    assert env.new_episode_metadata(7) == new_episode_metadata(7, 3, 10, 40)


def test_metadata_not_made_by_new_episode_metadata_is_a_clear_error():
    env = SlidingPuzzleEnv()
    with pytest.raises(ConfigError, match=r"board: expected 2 lists of 2 tiles holding 0..3"):
        reply(env, episode([[1, 2], [3, 3]]), "<action>up</action>")
    with pytest.raises(ConfigError) as info:
        reply(env, None, "<action>up</action>")
    assert info.value.problems == ["expected a mapping, got None"]
    with pytest.raises(ConfigError) as info:
        reply(env, {**episode([[1, 2], [3, 0]]), "board": [[1, "2"], [3, 0]], "sed": 0}, "")
    assert info.value.problems == [
        "board[0][1]: expected int, got str ('2')",
        "sed: unknown option. Did you mean 'seed'?",
    ]


def test_metrics():
    from envloop.distributed.batched_data_dict import BatchedDataDict

    batch = BatchedDataDict(extra_env_info=[
        episode(solved_board(2), moves_made=4, invalid_moves=1),
        episode([[2, 0], [1, 3]], max_moves=5, moves_made=5, invalid_moves=2),
        episode([[2, 0], [1, 3]], max_moves=5, moves_made=1),
        None,
    ])  # fmt: skip
    _, metrics = SlidingPuzzleEnv().global_post_process_and_metrics(batch)
    assert metrics == {
        "sliding_puzzle_env/num_episodes": 3,
        "sliding_puzzle_env/solve_rate": pytest.approx(1 / 3),
        "sliding_puzzle_env/mean_moves": pytest.approx(10 / 3),
        "sliding_puzzle_env/invalid_move_rate": pytest.approx(3 / 10),
        "sliding_puzzle_env/move_limit_rate": pytest.approx(1 / 3),
        "sliding_puzzle_env/over_max_parse_chars": 0,
    }


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"
ADVERSARIAL = ["slide 1 " * 150_000, "<action>" * 200_000, "<action>slide 1 " * 75_000]


def replies(env, metadata, texts):
    logs = [[{"role": "user", "content": "go"}, {"role": "assistant", "content": t}] for t in texts]
    return env.step(logs, metadata)


def test_megabyte_replies_over_the_default_cap_are_not_played():
    env = SlidingPuzzleEnv()
    start = episode(NEARLY)
    ret = replies(env, [start] * 4, ["<action>left</action>", *ADVERSARIAL])
    assert ret.rewards.tolist() == [0.0] * 4
    assert ret.terminateds.tolist() == [False, True, True, True]
    assert ret.metadata[0]["moves_made"] == 1
    reasons = [f"response has {len(r):,} characters, {OVER_CAP}" for r in ADVERSARIAL]
    assert reasons[0] == f"response has 1,200,000 characters, {OVER_CAP}"
    assert ret.metadata[1:] == [{**start, "puzzle_error": why} for why in reasons]
    assert [o["content"] for o in ret.observations[1:]] == [
        f"Not played, so the episode ends with reward 0: {why}." for why in reasons
    ]
    assert ret.answers == ["left", None, None, None]
    logs = [[{"role": "assistant", "content": t}] for t in ["<action>left</action>", *ADVERSARIAL]]
    batch = BatchedDataDict(message_log=logs, extra_env_info=ret.metadata)
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["sliding_puzzle_env/over_max_parse_chars"] == 3
    assert metrics["sliding_puzzle_env/num_episodes"] == 4  # unplayed, their boards still count


def test_megabyte_replies_under_the_default_cap_are_played_exactly():
    """Just under the cap, a megabyte of repeated markup before the move is read in one pass."""
    env = SlidingPuzzleEnv()
    texts = [
        "slide 1 " * 124_000 + "<action>left</action>",
        "<action>" * 124_000 + "</action><action>left</action>",
        "<action>slide " + "1" * 990_000 + " 1</action>",  # a square no board has
    ]
    assert max(len(t) for t in texts) < 1_000_000 < min(len(t) for t in texts) + 10_000
    ret = replies(env, [episode(NEARLY) for _ in texts], texts)
    assert ret.rewards.tolist() == [0.0, 0.0, 0.0]
    moved = [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    assert [(md["board"], md["invalid_moves"]) for md in ret.metadata] == [
        (moved, 0), (moved, 0), (NEARLY, 1),
    ]  # fmt: skip
    assert ret.observations[2]["content"].startswith("Invalid move 'slide 1111")


def test_replies_up_to_the_cap_are_played_exactly():
    env = SlidingPuzzleEnv({"max_parse_chars": 2_000, "move_penalty": 0.5})
    texts = ["slide 1 " * 247 + "<action>left</action>", "slide 1 " * 250, "slide 1 " * 250 + "!"]
    assert [len(t) for t in texts] == [1_997, 2_000, 2_001]
    ret = replies(env, [episode(NEARLY)] * 3, texts)
    assert ret.rewards.tolist() == [-0.5, -0.5, 0.0]
    assert ret.terminateds.tolist() == [False, False, True]
    assert [md["board"] for md in ret.metadata[:2]] == [
        [[1, 2, 3], [4, 5, 6], [7, 0, 8]], NEARLY,
    ]  # fmt: skip
    assert ret.observations[1]["content"].startswith(NO_ACTION)
    assert ret.metadata[2]["puzzle_error"] == (
        "response has 2,001 characters, over max_parse_chars=2,000; raise max_parse_chars to "
        "score it"
    )


POISONS = {
    "none": None,
    "not_a_mapping": [[1, 2, 3]],
    "missing_key": {k: v for k, v in episode(NEARLY).items() if k != "moves_made"},
    "huge_int": {**episode(NEARLY), "size": 10**5000},
    "huge_int_tile": {**episode(NEARLY), "board": [[1, 2, 3], [4, 5, 6], [0, 7, 10**5000]]},
    "nested": {**episode(NEARLY), "board": {"rows": NEARLY}},
    "str_counts": {**episode(NEARLY), "moves_made": "0"},
}


@pytest.mark.parametrize("poison", list(POISONS.values()), ids=list(POISONS))
def test_one_poisoned_sample_fails_alone_and_the_others_play(poison):
    env = SlidingPuzzleEnv()
    texts = ["<action>left</action>", "<action>up</action>", "<action>left</action>"]
    ret = replies(env, [episode(NEARLY), poison, episode(NEARLY)], texts)
    assert ret.rewards.tolist() == [0.0, 0.0, 0.0]
    assert ret.terminateds.tolist() == [False, True, False]
    assert [md["board"] for md in (ret.metadata[0], ret.metadata[2])] == [
        [[1, 2, 3], [4, 5, 6], [7, 0, 8]]
    ] * 2
    # The poisoned sample fails through `errors` (the rollout records it, loss_multiplier 0);
    # its metadata comes back unchanged, and metrics leave it out.
    assert ret.errors[0] is None and ret.errors[2] is None
    assert ret.errors[1].startswith(
        "SlidingPuzzleEnv.step_sample raised envloop.config.errors.ConfigError: Invalid "
        "sliding_puzzle episode metadata (use new_episode_metadata):\n  - "
    )
    assert ret.metadata[1] is poison
    batch = BatchedDataDict(extra_env_info=ret.metadata)
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["sliding_puzzle_env/num_episodes"] == 2
    assert metrics["sliding_puzzle_env/mean_moves"] == 1.0


def test_an_int_too_long_to_print_is_reported_as_a_metadata_problem():
    env = SlidingPuzzleEnv()
    with pytest.raises(ConfigError) as info:
        reply(env, {**episode(NEARLY), "size": 10**5000}, "<action>left</action>")
    assert info.value.problems == [
        "ValueError: Exceeds the limit (4300 digits) for integer string conversion; use "
        "sys.set_int_max_str_digits() to increase the limit"
    ]


CHECK_LOGS = [
    [{"role": "user", "content": "go"}, {"role": "assistant", "content": "<action>left</action>"}],
    [{"role": "user", "content": "go"}, {"role": "assistant", "content": "I think up"}],
]
CHECK_METADATA = [episode([[1, 2, 3], [4, 5, 6], [7, 0, 8]]), episode([[2, 0], [1, 3]])]


def test_check_env_in_process():
    ret = check_env(SlidingPuzzleEnv(), CHECK_LOGS, CHECK_METADATA)
    assert ret.rewards.tolist() == [1.0, 0.0] and ret.terminateds.tolist() == [True, False]
    assert ret.answers == ["left", None]


@pytest.mark.ray
def test_check_env_as_a_ray_actor(ray_session):
    register_env(
        "test_sliding_puzzle",
        "envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv",
        overwrite=True,
    )
    actor = create_env("test_sliding_puzzle", {"default_size": 2}, num_cpus=0)
    ret = check_env(actor, CHECK_LOGS, CHECK_METADATA)
    assert ret.rewards.tolist() == [1.0, 0.0]
    assert (
        ret.observations == check_env(SlidingPuzzleEnv(), CHECK_LOGS, CHECK_METADATA).observations
    )
    assert ray_session.get(actor.new_episode_metadata.remote(3)) == new_episode_metadata(
        3, 2, 10, 40
    )


# --- whole episodes through the rollout engine --------------------------------------------

PUZZLES = [(2, 3, 0), (2, 5, 1), (3, 6, 0), (3, 10, 1), (3, 14, 3)]  # (size, shuffle, seed)


def test_scripted_bfs_solver_solves_every_puzzle_in_exactly_its_distance(tiny_tokenizer):
    episodes = [new_episode_metadata(seed, size, shuffle, 40) for size, shuffle, seed in PUZZLES]
    lengths = [distance(md["board"]) for md in episodes]
    assert lengths == [3, 5, 6, 10, 14]
    samples = [
        {"task": "sliding_puzzle", "prompt": initial_prompt(md), "metadata": md} for md in episodes
    ]
    env = SlidingPuzzleEnv()
    policy = ScriptedGeneration(tiny_tokenizer, solver_reply)
    final, metrics = run_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, {"sliding_puzzle": env}, 4096
    )
    assert final["num_turns"].tolist() == lengths
    assert final["total_reward"].tolist() == [1.0] * 5
    assert final["turn_rewards"] == [[0.0] * (k - 1) + [1.0] for k in lengths]
    assert final["terminated"].tolist() == [True] * 5 and final["truncated"].tolist() == [False] * 5
    assert [md["moves_made"] for md in final["extra_env_info"]] == lengths
    assert all(
        is_solved(md["board"]) and md["invalid_moves"] == 0 for md in final["extra_env_info"]
    )
    for log, k, (size, _, _) in zip(final["message_log"], lengths, PUZZLES):
        solved = render(solved_board(size), show_moves=False)
        assert log[-1]["content"].endswith(f"Solved in {k} moves!\n{solved}")
        assert all(m["content"].endswith("</action>") for m in log[3::2])  # cut at the stop
    # No stop strings on the first turn; the environment's ["</action>"] on every later one.
    assert policy.calls[0] == [None] * 5
    assert len(policy.calls) == 14
    assert all(stops == ["</action>"] for call in policy.calls[1:] for stops in call)
    assert [len(call) for call in policy.calls] == [sum(k > t for k in lengths) for t in range(14)]
    _, env_metrics = env.global_post_process_and_metrics(final)
    assert env_metrics["sliding_puzzle_env/solve_rate"] == 1.0
    assert env_metrics["sliding_puzzle_env/mean_moves"] == sum(lengths) / 5
    assert env_metrics["sliding_puzzle_env/invalid_move_rate"] == 0.0
    assert metrics["natural_termination_rate"] == 1.0
