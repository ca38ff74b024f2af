"""Progress of ``envloop run``: a live bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from envloop.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def finished(task: str, reward: float, turns: int, n: int = 1) -> list[dict]:
    return [{"task": task, "total_reward": reward, "num_turns": turns}] * n


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    progress = Progress(total=4, stream=out)
    progress.start()
    progress.update(finished("math", 1.0, 1, n=2))
    progress.update(finished("puzzle", 0.5, 3) + finished("math", 0.0, 1))
    progress.close()
    lines = [line.rsplit(", ", 1)[0] for line in out.getvalue().splitlines()]
    assert lines == [
        "progress: 2/4 samples, 2 turns, mean reward: math 1.000 (2)",
        "progress: 4/4 samples, 6 turns, mean reward: math 0.667 (3), puzzle 0.500 (1)",
    ]
    assert all(line.endswith(" s") for line in out.getvalue().splitlines())


def test_live_bar_on_a_terminal_redraws_one_line():
    out = Terminal()
    progress = Progress(total=4, stream=out)
    progress.start()
    progress.update(finished("math", 1.0, 2))
    progress.update(finished("math", 0.0, 1, n=3))
    progress.close()
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    empty, first, second = text.split("\r")[1:]
    assert empty == "[------------------------] 0/4 samples, 0 turns, mean reward: -, 0.0 s\x1b[K"
    assert first.startswith(
        "[######------------------] 1/4 samples, 2 turns, mean reward: math 1.000 (1)"
    )
    assert second.startswith(
        "[########################] 4/4 samples, 5 turns, mean reward: math 0.250 (4)"
    )


def test_quiet_prints_log_lines_even_on_a_terminal():
    out = Terminal()
    progress = Progress(total=1, stream=out, quiet=True)
    progress.update(finished("math", 1.0, 1))
    progress.close()
    assert out.getvalue().startswith("progress: 1/1 samples, 1 turns, mean reward: math 1.000 (1)")
    assert "\r" not in out.getvalue()
