"""Nothing an environment does stalls a rollout or poisons a batch (issue 15): a step that
hangs forever, a constructor that never returns, NaN and infinite rewards, empty inputs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from envloop.environments import EnvironmentContractError, check_env
from envloop.experience.env_dispatch import EnvDispatcher
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.conftest import REPO_ROOT
from tests.fixtures.batches import make_batch
from tests.fixtures.containment_envs import HangOnRequestEnv, NeverStartsEnv, NonFiniteRewardEnv
from tests.fixtures.envs import EchoEnv


def respond(prompt: str) -> str:
    return "I will hang now" if "please hang" in prompt else "fine"


@pytest.fixture
def policy(tiny_tokenizer):
    return ScriptedGeneration(tiny_tokenizer, respond)


def samples(*tasks_and_prompts: tuple[str, str], **extra) -> list[dict]:
    return [{"task": t, "prompt": p, **extra} for t, p in tasks_and_prompts]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def release(tmp_path):
    """A file whose creation (at teardown) ends every hang of the test's environments."""
    path = tmp_path / "release"
    yield path
    path.touch()


@pytest.mark.ray
def test_a_step_that_hangs_does_not_hold_up_later_rollouts_on_the_same_handle(
    ray_session, tiny_tokenizer, policy, release, tmp_path
):
    calls = tmp_path / "calls"
    hang = HangOnRequestEnv.options(num_cpus=0).remote(str(release), str(calls))
    echo = EchoEnv.options(num_cpus=0).remote()
    envs = {"h": hang, "e": echo}
    try:
        batch = make_batch(tiny_tokenizer, samples(("h", "please hang"), ("e", "hi")))
        final, _ = run_multi_turn_rollout(
            policy, batch, tiny_tokenizer, envs, 256, max_rollout_turns=1, env_step_timeout_s=3
        )
        assert final["env_error"][0] == (
            "env h.step timed out after 3.0 s; its actor was killed for Ray to restart (Ray "
            "cannot stop a running step, and later steps would queue behind it)"
        )
        assert final["env_error"][1] is None and final["total_reward"].tolist() == [0.0, 0.5]
        [hung_pid] = [int(line) for line in calls.read_text().split()]

        for _ in range(2):  # the same handle, later rollouts: served by a fresh actor
            batch = make_batch(tiny_tokenizer, samples(("h", "a"), ("h", "b"), ("e", "c")))
            final, _ = run_multi_turn_rollout(
                policy, batch, tiny_tokenizer, envs, 256, max_rollout_turns=1,
                env_step_timeout_s=20,
            )  # fmt: skip
            assert final["env_error"] == [None, None, None]
            assert final["total_reward"].tolist() == [1.0, 1.0, 0.5]
            pids = {md["pid"] for md in final["extra_env_info"][:2]}
            assert len(pids) == 1 and hung_pid not in pids
        assert not pid_alive(hung_pid)  # the actor process that hung is gone
        assert calls.read_text().split() == [str(hung_pid)]  # and its step was never retried
    finally:
        ray_session.kill(hang)
        ray_session.kill(echo)


@pytest.mark.ray
def test_an_environment_that_never_starts_fails_only_its_samples(
    ray_session, tiny_tokenizer, policy, release, tmp_path
):
    never = NeverStartsEnv.options(num_cpus=0).remote(str(release), str(tmp_path / "calls"))
    echo = EchoEnv.options(num_cpus=0).remote()
    try:
        ray_session.get(echo.__ray_ready__.remote())  # a worker's own start takes seconds here
        batch = make_batch(tiny_tokenizer, samples(("n", "a"), ("e", "b"), ("n", "c")))
        final, metrics = run_multi_turn_rollout(
            policy, batch, tiny_tokenizer, {"n": never, "e": echo}, 256, max_rollout_turns=1,
            env_step_timeout_s=30, env_startup_timeout_s=2,
        )  # fmt: skip
        error = (
            "env n did not start within env_startup_timeout_s=2.0 s (its actor's constructor is "
            "still running); raise env_startup_timeout_s if it needs longer, or fix what it "
            "waits for"
        )
        assert final["env_error"] == [error, None, error]
        assert final["loss_multiplier"] == [0.0, 1.0, 0.0]
        assert final["total_reward"].tolist() == [0.0, 0.5, 0.0]
        assert metrics["env_error_rate"] == pytest.approx(2 / 3)
    finally:
        ray_session.kill(never)
        ray_session.kill(echo)


@pytest.mark.ray
def test_the_async_engine_bounds_start_up_and_hung_steps_too(
    ray_session, tiny_tokenizer, policy, release, tmp_path
):
    calls = tmp_path / "calls"
    never = NeverStartsEnv.options(num_cpus=0).remote(str(release), str(tmp_path / "unused"))
    hang = HangOnRequestEnv.options(num_cpus=0).remote(str(release), str(calls))
    echo = EchoEnv.options(num_cpus=0).remote()
    envs = {"n": never, "h": hang, "e": echo}
    try:
        ray_session.get([hang.__ray_ready__.remote(), echo.__ray_ready__.remote()])
        rows = samples(("n", "a"), ("h", "please hang"), ("e", "fine"))
        final, _ = asyncio.run(
            run_async_multi_turn_rollout(
                policy, make_batch(tiny_tokenizer, rows), tiny_tokenizer, envs, 256,
                max_rollout_turns=1, env_step_timeout_s=3, env_startup_timeout_s=2,
            )
        )  # fmt: skip
        errors = final["env_error"]
        assert errors[0].startswith("env n did not start within env_startup_timeout_s=2.0 s")
        assert errors[1].startswith("env h.step timed out after 3.0 s; its actor was killed for")
        assert errors[2] is None and final["total_reward"].tolist() == [0.0, 0.0, 0.5]
        [hung_pid] = [int(line) for line in calls.read_text().split()]

        rows = samples(("h", "a"), ("h", "b"))
        final, _ = asyncio.run(
            run_async_multi_turn_rollout(
                policy, make_batch(tiny_tokenizer, rows), tiny_tokenizer, envs, 256,
                max_rollout_turns=1, env_step_timeout_s=20,
            )
        )  # fmt: skip
        assert final["env_error"] == [None, None]
        assert final["total_reward"].tolist() == [1.0, 1.0]
        assert hung_pid not in {md["pid"] for md in final["extra_env_info"]}
    finally:
        for actor in envs.values():
            ray_session.kill(actor)


def test_an_abandoned_in_process_step_holds_no_slot_of_the_async_engine(
    tiny_tokenizer, policy, release, tmp_path
):
    env = HangOnRequestEnv(str(release), str(tmp_path / "calls"))
    rows = samples(("h", "please hang"), ("h", "fine"), ("h", "fine too"))
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, make_batch(tiny_tokenizer, rows), tiny_tokenizer, {"h": env}, 256,
            max_rollout_turns=1, env_step_timeout_s=2, max_concurrent_samples=1,
        )
    )  # fmt: skip
    assert final["env_error"] == ["env h.step timed out after 2.0 s", None, None]
    assert final["total_reward"].tolist() == [0.0, 1.0, 1.0]


_EXITS_WITH_A_HUNG_STEP = textwrap.dedent(
    """
    import threading
    from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
    from envloop.models.generation.scripted_generation import ScriptedGeneration
    from tests.fixtures.batches import make_batch
    from tests.fixtures.containment_envs import BlockForeverEnv, BlockForeverSampleEnv
    from tests.fixtures.tiny_models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    policy = ScriptedGeneration(tokenizer, lambda p: "block" if "stuck" in p else "fine")
    rows = [{"task": "b", "prompt": "x"}, {"task": "s", "prompt": "stuck"},
            {"task": "s", "prompt": "fine"}]
    envs = {"b": BlockForeverEnv(), "s": BlockForeverSampleEnv()}
    final, _ = run_multi_turn_rollout(policy, make_batch(tokenizer, rows), tokenizer, envs,
                                      256, max_rollout_turns=1, env_step_timeout_s=2)
    print(final["env_error"])
    print(sorted(t.name for t in threading.enumerate() if t.is_alive() and not t.daemon))
    """
)


def test_an_in_process_step_that_hangs_does_not_keep_the_interpreter_alive():
    # The timeout only stops a broken engine from hanging the suite: the script ends at once.
    done = subprocess.run(
        [sys.executable, "-c", _EXITS_WITH_A_HUNG_STEP], cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    errors, threads = done.stdout.strip().splitlines()[-2:]
    # The sync engine steps each task's samples in one call; "s" streams its samples, so
    # the healthy one is delivered and only the stuck one times out.
    assert errors == str(
        ["env b.step timed out after 2.0 s", "env s.step timed out after 2.0 s", None]
    )
    assert threads == "['MainThread']"


def test_non_finite_rewards_fail_only_their_samples(tiny_tokenizer, policy):
    rewards = [1.0, float("nan"), float("inf"), 0.0, float("-inf")]
    rows = [
        {"task": "r", "prompt": str(i), "metadata": {"reward": r}} for i, r in enumerate(rewards)
    ]
    final, metrics = run_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, rows), tiny_tokenizer, {"r": NonFiniteRewardEnv()}, 256
    )
    hint = "rewards must be finite numbers (a NaN or inf would poison its group's advantages)"
    broke = "env r: step broke the EnvironmentReturn contract for this sample"
    assert final["env_error"] == [
        None, f"{broke}: reward is nan; {hint}", f"{broke}: reward is inf; {hint}", None,
        f"{broke}: reward is -inf; {hint}",
    ]  # fmt: skip
    assert final["total_reward"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert torch.isfinite(final["total_reward"]).all()
    assert final["loss_multiplier"] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert metrics["env_error_rate"] == pytest.approx(3 / 5)


def test_a_non_finite_reward_component_fails_its_sample():
    dispatcher = EnvDispatcher({"r": NonFiniteRewardEnv(components=True)})
    logs = [[{"role": "assistant", "content": "x"}]] * 2
    results = dispatcher.step({"r": [0, 1]}, logs, [{"reward": 0.5}, {"reward": float("nan")}])
    assert [(r.indices, r.error) for r in results] == [
        ([0], None),
        (
            [1],
            "env r: step broke the EnvironmentReturn contract for this sample: "
            "rewards['reward/score'] is nan; rewards must be finite numbers (a NaN or inf "
            "would poison its group's advantages)",
        ),
    ]
    assert results[0].result.rewards["reward/score"].tolist() == [0.5]


def test_check_env_reports_non_finite_rewards():
    logs = [[{"role": "assistant", "content": "x"}]] * 3
    metadata = [{"reward": 1.0}, {"reward": float("nan")}, {"reward": float("-inf")}]
    with pytest.raises(EnvironmentContractError) as info:
        check_env(NonFiniteRewardEnv(components=True), logs, metadata)
    hint = "rewards must be finite numbers (a NaN or inf would poison its group's advantages)"
    assert info.value.problems == [
        f"sample 1: rewards['reward/score'] is nan; {hint}",
        f"sample 2: rewards['reward/score'] is -inf; {hint}",
    ]


def test_a_sample_with_an_empty_message_log_is_rejected_up_front(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, samples(("e", "a"), ("e", "b"), ("e", "c")))
    batch["message_log"] = [batch["message_log"][0], [], []]
    with pytest.raises(ValueError) as info:
        run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"e": EchoEnv()}, 256)
    assert str(info.value) == (
        "Sample(s) 1, 2 of the input batch have an empty prompt (an empty message_log, or "
        "messages whose token_ids are all empty), so nothing would condition their generation. "
        "Give each a tokenized prompt (e.g. get_formatted_message_log) or drop those samples."
    )


def test_a_sample_whose_messages_hold_no_tokens_is_rejected_up_front(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, samples(("e", "a"), ("e", "b")))
    empty = torch.zeros(0, dtype=torch.long)
    no_tokens = [{"role": "user", "content": "", "token_ids": empty}]
    batch["message_log"] = [no_tokens, batch["message_log"][1]]
    with pytest.raises(ValueError, match=r"^Sample\(s\) 0 of the input batch have an empty prompt"):
        run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"e": EchoEnv()}, 256)
