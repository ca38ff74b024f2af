"""``examples/demo.yaml`` end to end, as ``make demo`` runs it (one generation per prompt
here, to keep the suite quick): the bundled policy against math with retries, sliding
puzzles and the bundled reward model, each a Ray actor."""

from __future__ import annotations

import pytest

from envloop.demo.tasks import demo_rows
from tests.fixtures.demo_runs import run_example

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, ray_session):
    out_dir = tmp_path_factory.mktemp("demo") / "run"
    return run_example("demo.yaml", out_dir)


def test_demo_prints_a_summary_of_all_three_tasks(demo_run):
    status, printed, records = demo_run
    assert status == 0, printed
    assert len(records) == len(demo_rows())
    lines = printed.splitlines()
    header = lines.index("task            samples  mean reward  mean turns")
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == [
        "math",
        "sliding_puzzle",
        "reward_model",
    ]


def test_policy_earns_math_reward_with_retries_and_solves_puzzles(demo_run):
    _, _, records = demo_run
    math = [r for r in records if r["task"] == "math"]
    assert sum(r["total_reward"] for r in math) / len(math) > 0.5
    for record in math:  # every answer got a verdict; a wrong one, another try (up to 3)
        verdicts = [m["content"] for m in record["messages"] if m["role"] == "environment"]
        assert len(verdicts) == record["num_turns"] <= 3
        assert all(v == "Environment: incorrect" for v in verdicts[:-1])
        assert (verdicts[-1] == "Environment: correct") == (record["total_reward"] == 1.0)
    puzzles = [r for r in records if r["task"] == "sliding_puzzle"]
    assert any(r["total_reward"] == 1.0 for r in puzzles)
    assert all(m["content"].startswith("<action>") for r in puzzles
               for m in r["messages"] if m["role"] == "assistant")  # fmt: skip


def test_reward_model_scores_the_policys_arithmetic(demo_run):
    """Most right replies (checked against the row's ground truth) score above 0, as the
    reward model was trained to (about 95% of held-out replies land on the right side of
    0; an untrained score head would put half of them there)."""
    _, _, records = demo_run
    scored = [r for r in records if r["task"] == "reward_model"]
    assert len(scored) == 6 and all(r["num_turns"] == 1 for r in scored)
    right = [
        r["total_reward"] > 0
        for r in scored
        if r["messages"][1]["content"].endswith(f"\\boxed{{{r['ground_truth']}}}")
    ]
    assert len(right) >= 4 and sum(right) >= len(right) - 1
