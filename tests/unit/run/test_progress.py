"""Progress of ``envloop run``: a live bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from envloop.experience.rollout_metrics import RolloutProgress
from envloop.run.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished(task: str, reward: float, turns: int, n: int = 1) -> list[dict]:
    return [{"task": task, "total_reward": reward, "num_turns": turns}] * n


def running(done: int, turns: int, tokens: int, seconds: float) -> RolloutProgress:
    return RolloutProgress(
        samples=2,
        samples_done=done,
        turns=turns,
        generated_tokens=tokens,
        generation_s=seconds,
        elapsed_s=0.0,
    )


def test_plain_lines_when_not_a_terminal():
    out, clock = io.StringIO(), Clock()
    progress = Progress(total=4, stream=out, clock=clock)
    progress.start()
    clock.now += 1.5
    progress.update(finished("math", 1.0, 1, n=2), generated_tokens=100, generation_s=0.5)
    clock.now += 2.0
    progress.update(finished("puzzle", 0.5, 3) + finished("math", 0.0, 1))
    progress.close()
    assert out.getvalue().splitlines() == [
        "progress: 2/4 samples, 2 turns, 100 tokens, 200 tokens/s, "
        "mean reward: math 1.000 (2), 1.5 s",
        "progress: 4/4 samples, 6 turns, 100 tokens, 200 tokens/s, "
        "mean reward: math 0.667 (3), puzzle 0.500 (1), 3.5 s",
    ]


def test_plain_lines_within_a_batch_come_at_most_once_per_interval():
    out, clock = io.StringIO(), Clock()
    progress = Progress(total=4, stream=out, clock=clock, log_interval_s=10.0)
    progress.start()
    clock.now += 4.0
    progress.on_turn(running(0, 2, 50, 1.0))  # 4 s after the start: not yet
    clock.now += 6.0
    progress.on_turn(running(1, 4, 120, 2.0))  # 10 s: a line
    clock.now += 9.0
    progress.on_turn(running(1, 5, 150, 3.0))  # 9 s after that line: not yet
    clock.now += 1.0
    progress.update(finished("math", 1.0, 3, n=2), generated_tokens=160, generation_s=3.2)
    assert out.getvalue().splitlines() == [
        "progress (running): 1/4 samples, 4 turns, 120 tokens, 60 tokens/s, mean reward: -, 10.0 s",
        "progress: 2/4 samples, 6 turns, 160 tokens, 50 tokens/s, "
        "mean reward: math 1.000 (2), 20.0 s",
    ]  # a finished batch always prints; its totals replace the running numbers


def test_live_bar_on_a_terminal_redraws_one_line():
    out, clock = Terminal(), Clock()
    progress = Progress(total=4, stream=out, clock=clock)
    progress.start()
    clock.now += 1.0
    progress.on_turn(running(1, 2, 30, 0.5))
    progress.update(finished("math", 1.0, 2), generated_tokens=40, generation_s=0.5)
    clock.now += 1.0
    progress.update(finished("math", 0.0, 1, n=3), generated_tokens=40, generation_s=0.5)
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    assert text.split("\r")[1:] == [
        "[------------------------] 0/4 samples, 0 turns, 0 tokens, - tokens/s, "
        "mean reward: -, 0.0 s\x1b[K",
        "[######------------------] 1/4 samples, 2 turns, 30 tokens, 60 tokens/s, "
        "mean reward: -, 1.0 s\x1b[K",
        "[######------------------] 1/4 samples, 2 turns, 40 tokens, 80 tokens/s, "
        "mean reward: math 1.000 (1), 1.0 s\x1b[K",
        "[########################] 4/4 samples, 5 turns, 80 tokens, 80 tokens/s, "
        "mean reward: math 0.250 (4), 2.0 s\x1b[K\n",
    ]


def test_quiet_prints_log_lines_even_on_a_terminal():
    out = Terminal()
    progress = Progress(total=1, stream=out, quiet=True)
    progress.update(finished("math", 1.0, 1))
    progress.close()
    assert out.getvalue().startswith(
        "progress: 1/1 samples, 1 turn, 0 tokens, - tokens/s, mean reward: math 1.000 (1)"
    )
    assert "\r" not in out.getvalue()


def test_tokens_generated_mid_turn_redraw_at_a_bounded_rate():
    out, clock = Terminal(), Clock()
    progress = Progress(total=2, stream=out, clock=clock)
    progress.start()  # a redraw at 0.0 s
    clock.now += 0.2
    progress.on_tokens(2)  # 0.2 s after the last redraw: counted, not drawn
    clock.now += 0.3
    progress.on_tokens(2)  # 0.5 s: drawn
    progress.on_turn(running(0, 2, 5, 1.0))  # the turn's own count replaces the live one
    clock.now += 0.1
    progress.on_tokens(1)  # 0.1 s after the turn's redraw: counted, not drawn
    progress.close()
    assert [line.split(", mean")[0] for line in out.getvalue().split("\r")[1:]] == [
        "[------------------------] 0/2 samples, 0 turns, 0 tokens, - tokens/s",
        "[------------------------] 0/2 samples, 0 turns, 4 tokens, - tokens/s",
        "[------------------------] 0/2 samples, 2 turns, 5 tokens, 5 tokens/s",
    ]
    assert progress.line(0.0).startswith("0/2 samples, 2 turns, 6 tokens, 5 tokens/s")


def test_tokens_generated_mid_turn_log_a_line_at_most_once_per_interval():
    out, clock = io.StringIO(), Clock()
    progress = Progress(total=2, stream=out, clock=clock, log_interval_s=10.0)
    progress.start()
    for _ in range(30):  # 30 steps of 2 tokens, one per second
        clock.now += 1.0
        progress.on_tokens(2)
    assert out.getvalue().splitlines() == [
        "progress (running): 0/2 samples, 0 turns, 20 tokens, - tokens/s, mean reward: -, 10.0 s",
        "progress (running): 0/2 samples, 0 turns, 40 tokens, - tokens/s, mean reward: -, 20.0 s",
        "progress (running): 0/2 samples, 0 turns, 60 tokens, - tokens/s, mean reward: -, 30.0 s",
    ]


def test_async_rollouts_count_each_sample_as_it_finishes():
    out, clock = Terminal(), Clock()
    progress = Progress(total=4, stream=out, clock=clock, per_sample=True)
    progress.start()
    clock.now += 1.0
    progress.on_turn(running(2, 2, 30, 0.5))  # two samples ended; neither handed over yet
    progress.on_sample({"task": "math", "total_reward": 1.0, "num_turns": 1})
    progress.on_sample({"task": "puzzle", "total_reward": 0.5, "num_turns": 1})
    clock.now += 1.0
    progress.update(
        finished("math", 1.0, 1) + finished("puzzle", 0.5, 1), generated_tokens=40,
        generation_s=0.5,
    )  # fmt: skip
    progress.on_sample({"task": "math", "total_reward": 0.0, "num_turns": 3})
    assert [line.split("\x1b")[0] for line in out.getvalue().split("\r")[1:]] == [
        "[------------------------] 0/4 samples, 0 turns, 0 tokens, - tokens/s, "
        "mean reward: -, 0.0 s",
        "[------------------------] 0/4 samples, 2 turns, 30 tokens, 60 tokens/s, "
        "mean reward: -, 1.0 s",
        "[######------------------] 1/4 samples, 2 turns, 30 tokens, 60 tokens/s, "
        "mean reward: math 1.000 (1), 1.0 s",
        "[############------------] 2/4 samples, 2 turns, 30 tokens, 60 tokens/s, "
        "mean reward: math 1.000 (1), puzzle 0.500 (1), 1.0 s",
        "[############------------] 2/4 samples, 2 turns, 40 tokens, 80 tokens/s, "
        "mean reward: math 1.000 (1), puzzle 0.500 (1), 2.0 s",  # the batch's records, once
        "[##################------] 3/4 samples, 2 turns, 40 tokens, 80 tokens/s, "
        "mean reward: math 0.500 (2), puzzle 0.500 (1), 2.0 s",
    ]
    assert progress.finished == 2  # finished batches; the running one's sample is on top


def test_async_rollouts_log_finished_samples_at_most_once_per_interval():
    out, clock = io.StringIO(), Clock()
    progress = Progress(total=3, stream=out, clock=clock, per_sample=True, log_interval_s=10.0)
    progress.start()
    for _ in range(3):
        clock.now += 6.0
        progress.on_sample({"task": "math", "total_reward": 1.0, "num_turns": 1})
    progress.update(finished("math", 1.0, 1, n=3), generated_tokens=30, generation_s=1.0)
    assert out.getvalue().splitlines() == [
        "progress (running): 2/3 samples, 0 turns, 0 tokens, - tokens/s, "
        "mean reward: math 1.000 (2), 12.0 s",
        "progress: 3/3 samples, 3 turns, 30 tokens, 30 tokens/s, "
        "mean reward: math 1.000 (3), 18.0 s",
    ]


def test_a_turn_takes_only_the_tokens_it_counts_from_the_live_count():
    """In an async rollout, rows may still be generating when another sample's turn ends."""
    progress = Progress(total=4, stream=io.StringIO(), per_sample=True)
    progress.on_tokens(10)  # rows of two samples, finished, and of two still generating
    progress.on_turn(running(0, 2, 6, 1.0))  # the two finished rows' 6 tokens
    assert progress.line(0.0).startswith("0/4 samples, 2 turns, 10 tokens, 6 tokens/s")
    progress.on_tokens(4)
    progress.on_turn(running(0, 4, 16, 2.0))  # the other two: 10 tokens
    assert progress.line(0.0).startswith("0/4 samples, 4 turns, 16 tokens, 8 tokens/s")
