"""reverify on a hand-written run directory, with the real environments (math-verify in
worker processes, the sliding puzzle, a tiny reward model) in process and as Ray actors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from envloop.environments.games.sliding_puzzle import SlidingPuzzleEnv
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.reward_model_environment import RewardModelEnvironment
from envloop.report.reverify import format_reverify, reverify_run
from tests.fixtures.run_dirs import RetryMath, fixture_records, write_run_dir
from tests.fixtures.tiny_reward_model import save_tiny_reward_model


class BoxedOnly(EnvironmentInterface):
    """A stricter grader: reward 1 only when the whole reply is ``\\boxed{<truth>}``;
    two attempts, like the run's math environment."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        replies = [log[-1]["content"].strip() for log in message_log_batch]
        correct = [r == f"\\boxed{{{md['ground_truth']}}}" for r, md in zip(replies, metadata)]
        attempts = [md.get("attempts", 0) + 1 for md in metadata]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "graded"} for _ in replies],
            metadata=[{**md, "attempts": a} for md, a in zip(metadata, attempts)],
            next_stop_strings=[None] * len(replies),
            rewards=torch.tensor(correct, dtype=torch.float32),
            terminateds=torch.tensor([c or a >= 2 for c, a in zip(correct, attempts)]),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class LenientPuzzle(BoxedOnly):
    """Rewards any reply 0.5 and ends the episode: accepts even broken metadata."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        n = len(message_log_batch)
        return EnvironmentReturn(
            [{"role": "user", "content": "ok"}] * n, list(metadata), [None] * n,
            torch.full((n,), 0.5), torch.ones(n, dtype=torch.bool),
        )  # fmt: skip


class FailsOnFortyTwo(RetryMath):
    """The run's math environment, except that a batch holding ground truth 42 raises."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        if any(md["ground_truth"] == "42" for md in metadata):
            raise RuntimeError("cannot grade 42")
        return super().step(message_log_batch, metadata)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))


@pytest.fixture(scope="module")
def rm_env(rm_dir):
    return RewardModelEnvironment(
        {"model_name": str(rm_dir), "precision": "float32", "max_model_len": 512}
    )


@pytest.fixture(scope="module")
def rm_scores(rm_env) -> tuple[float, float]:
    """What the run's reward model gave the two preference samples."""
    logs = [
        [{"role": m["role"], "content": m["content"]} for m in r["messages"][:-1]]
        for r in fixture_records()[6:]
    ]
    first, second = rm_env.step(logs, [None, None]).rewards.tolist()
    assert abs(first - second) > 0.01  # distinct scores, so a swapped replay would show
    return first, second


@pytest.fixture
def run(tmp_path, rm_dir, rm_scores) -> Path:
    return write_run_dir(tmp_path / "run", rm_model_dir=str(rm_dir), rm_rewards=rm_scores)


def by_sample(summary: dict) -> dict[int, dict]:
    return {s["sample"]: s for s in summary["samples"]}


def edit_config(run: Path, edit) -> None:
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config))


def test_unchanged_environments_change_nothing(run):
    summary = reverify_run(run)
    assert summary["num_changed"] == 0 and summary["changed"] == []
    assert summary["status_counts"] == {
        "same": 7, "changed": 0, "error_fixed": 0, "new_error": 0, "still_error": 1,
    }  # fmt: skip
    for task in summary["per_task"].values():
        assert task["new_mean_reward"] == pytest.approx(task["old_mean_reward"], abs=1e-6)
    samples = by_sample(summary)
    assert samples[1]["new_turn_rewards"] == [0.0, 1.0] and samples[1]["replayed_turns"] == 2
    assert samples[4]["new_turn_rewards"] == [0.0, 1.0]  # its group-mate 5 failed alone
    assert samples[5]["status"] == "still_error"
    assert "board: expected 2 lists of 2 tiles holding 0..3" in samples[5]["new_error"]
    assert json.loads((run / "reverify.json").read_text()) == summary


def test_a_config_change_reports_exactly_the_changed_samples(run):
    def edit(config):
        config["envs"]["math"] = {"name": "math", "config": {"num_workers": 1}}  # no retries
        config["envs"]["sliding_puzzle"]["config"] = {"reward_on_solve": 2.0, "move_penalty": 0.25}

    edit_config(run, edit)
    summary = reverify_run(run)
    changed = {
        s["sample"]: (s["old_turn_rewards"], s["new_turn_rewards"], s["new_total_reward"])
        for s in summary["changed"]
    }
    assert changed == {
        1: ([0.0, 1.0], [0.0], 0.0),  # math now ends the episode after the first answer
        2: ([0.0, 0.0], [0.0], 0.0),
        4: ([0.0, 1.0], [-0.25, 1.75], 1.5),
    }
    assert {s["status"] for s in summary["changed"]} == {"changed"}
    assert summary["per_task"]["math"]["new_mean_reward"] == 0.25
    assert summary["per_task"]["sliding_puzzle"]["new_mean_reward"] == 0.75
    assert summary["per_task"]["preference"]["num_changed"] == 0
    text = format_reverify(summary)
    assert text.splitlines()[0] == (
        f"Re-verified 8 samples of {run}: 3 changed "
        "(same 4, changed 3, error_fixed 0, new_error 0, still_error 1)."
    )
    assert "  sample 4 (sliding_puzzle): 1 -> 1.5 changed" in text.splitlines()


def test_environments_passed_in_are_used_and_kept(run, rm_env):
    summary = reverify_run(
        run,
        {"math": BoxedOnly(), "sliding_puzzle": SlidingPuzzleEnv(), "preference": rm_env},
        write=False,
    )
    assert {s["sample"]: s["new_turn_rewards"] for s in summary["changed"]} == {
        0: [0.0],  # "6 * 7 = \boxed{42}" is more than the boxed answer
        1: [0.0, 0.0],
    }
    assert rm_env.model is not None  # not shut down: the caller owns it
    assert not (run / "reverify.json").exists()


def test_fixed_and_new_errors_are_told_apart(run, rm_env):
    math = FailsOnFortyTwo({"num_workers": 1})
    try:
        summary = reverify_run(
            run, {"math": math, "sliding_puzzle": LenientPuzzle(), "preference": rm_env}
        )
    finally:
        math.shutdown()
    status = {s["sample"]: s["status"] for s in summary["samples"]}
    assert status == {
        0: "new_error", 1: "new_error", 2: "same", 3: "same",  # 0 and 1 hold truth 42
        4: "changed", 5: "error_fixed", 6: "same", 7: "same",
    }  # fmt: skip
    samples = by_sample(summary)
    assert "RuntimeError: cannot grade 42" in samples[0]["new_error"]
    assert samples[4]["new_turn_rewards"] == [0.5] and samples[5]["new_total_reward"] == 0.5


def test_replay_starts_from_the_initial_metadata(tmp_path):
    puzzle = fixture_records()[4]  # initial: the scrambled board; final: the solved one
    older = {k: v for k, v in puzzle.items() if k != "initial_extra_env_info"}
    older["extra_env_info"] = puzzle["initial_extra_env_info"]  # a single-turn-style record
    broken_final = {**puzzle, "sample": 1, "extra_env_info": {"board": "not used"}}
    records = [puzzle, broken_final, {**older, "sample": 2}]
    run = write_run_dir(tmp_path / "run", records=records)
    summary = reverify_run(run, {"sliding_puzzle": SlidingPuzzleEnv()})
    assert [s["new_turn_rewards"] for s in summary["samples"]] == [[0.0, 1.0]] * 3
    assert summary["status_counts"]["same"] == 3


def test_a_task_without_an_environment_is_named(run):
    edit_config(run, lambda config: config["envs"].pop("preference"))
    with pytest.raises(ValueError, match=r"no environment for task\(s\) \['preference'\]"):
        reverify_run(run)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_actor_environments_give_the_same_answers(run, ray_session):
    records = [r for r in fixture_records() if r["task"] == "sliding_puzzle"]
    run = write_run_dir(run, records=records)
    summary = reverify_run(run, use_ray=True)
    assert summary["status_counts"] == {
        "same": 1, "changed": 0, "error_fixed": 0, "new_error": 0, "still_error": 1,
    }  # fmt: skip
    samples = by_sample(summary)
    assert samples[4]["new_turn_rewards"] == [0.0, 1.0]
    assert "board: expected 2 lists" in samples[5]["new_error"]
