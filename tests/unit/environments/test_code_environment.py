"""The ``code`` environment: real sandboxes, exact observations and rewards, multi-turn state."""

from __future__ import annotations

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.checker import check_env
from envloop.environments.code_environment import CodeEnvironment
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch

# Generous limits: on a loaded machine no run that must finish meets them; the test that
# expects the time limit uses its own short one and code that sleeps (no CPU to race with).
CFG = {"timeout_s": 60.0, "cpu_time_s": 30, "memory_mb": 256, "num_workers": 2}
TESTS = ["assert square(2) == 4", "assert square(3) == 9", "assert square(-1) == -1"]
NO_CODE = "No complete <code>...</code> block in the response, so the episode ends"


@pytest.fixture(scope="module")
def env():
    environment = CodeEnvironment(CFG)
    yield environment
    environment.shutdown()


def conversation(response: str) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": "Write square(n)."},
        {"role": "assistant", "content": response},
    ]


def step(env, responses, metadata):
    return env.step([conversation(r) for r in responses], metadata)


def test_state_persists_across_turns_of_an_episode(env):
    first = step(env, ["<code>x = 1</code>"], [{}])
    assert first.observations == [{"role": "tool", "content": "<result>\n</result>"}]
    assert first.metadata == [{"cells": ["x = 1"], "turns": 1}]
    assert first.next_stop_strings == [["</code>"]]
    assert first.terminateds.tolist() == [False] and first.rewards.tolist() == [0.0]
    second = step(env, ["I'll add one. <code>print(x + 1)\nx * 10</code>"], first.metadata)
    assert second.observations[0]["content"] == "<result>\n2\n10\n</result>"
    assert second.metadata == [{"cells": ["x = 1", "print(x + 1)\nx * 10"], "turns": 2}]
    assert second.answers == ["print(x + 1)\nx * 10"]


def test_a_response_without_code_ends_the_episode_and_scores_the_tests(env):
    md = {"tests": TESTS, "cells": ["def square(n):\n    return n * n"], "turns": 1}
    ret = step(env, ["Done."], [md])
    assert ret.observations == [{"role": "environment", "content": f"{NO_CODE}: 2/3 tests passed."}]
    assert ret.rewards.tolist() == [torch.tensor(2 / 3).item()]
    assert ret.terminateds.tolist() == [True] and ret.next_stop_strings == [None]
    assert ret.answers == [None]


def test_malformed_responses_get_zero_and_an_explanation(env):
    ret = step(env, ["I think it's n squared.", "<code>print(1)"], [{"tests": TESTS}, {}])
    expected = f"{NO_CODE} with reward 0. Write Python between <code> and </code>."
    assert [o["content"] for o in ret.observations] == [expected, expected]
    assert ret.rewards.tolist() == [0.0, 0.0] and ret.terminateds.tolist() == [True, True]


def test_the_turn_limit_runs_the_code_then_scores(env):
    md = {"tests": TESTS, "max_turns": 1}
    ret = step(env, ["<code>def square(n):\n    return n ** 2\nsquare(5)</code>"], [md])
    assert ret.observations[0]["content"] == (
        "<result>\n25\n</result>\nTurn limit reached, so the episode ends: 2/3 tests passed."
    )
    assert ret.terminateds.tolist() == [True]
    assert ret.rewards.tolist() == [torch.tensor(2 / 3).item()]


def test_errors_are_reported_and_the_failing_cell_kept_but_stopped_cells_dropped(env):
    ret = step(env, ["<code>y = 5\n1 / 0</code>"], [{}])
    assert ret.observations[0]["content"] == (
        "<result>\nZeroDivisionError: division by zero\n</result>"
    )
    assert ret.metadata[0]["cells"] == ["y = 5\n1 / 0"]
    after = step(env, ["<code>y</code>"], [ret.metadata[0]])  # what ran before the error stays
    assert after.observations[0]["content"] == "<result>\n5\n</result>"
    short = CodeEnvironment({**CFG, "timeout_s": 2.0})
    try:
        stopped = step(short, ["<code>import time\ntime.sleep(60)</code>"], [after.metadata[0]])
    finally:
        short.shutdown()
    assert stopped.observations[0]["content"] == (
        "<result>\nStopped: the code ran longer than the 2 s time limit.\n</result>"
    )
    assert stopped.metadata[0]["cells"] == ["y = 5\n1 / 0", "y"]


def test_no_tests_means_reward_zero(env):
    ret = step(env, ["done"], [{"cells": ["x = 1"], "turns": 1}])
    assert ret.observations[0]["content"] == f"{NO_CODE}: no tests to score (reward 0)."
    assert ret.rewards.tolist() == [0.0]


def test_bad_test_metadata_is_a_clear_error(env):
    with pytest.raises(ValueError, match=r"^metadata: tests: expected list\[str\], got str"):
        step(env, ["done"], [{"tests": "assert True"}])


def test_config_errors_name_every_bad_key():
    bad = {"num_worker": 2, "timeout_s": 0, "stop_strings": "x", "memory_mb": "big"}
    with pytest.raises(ConfigError) as info:
        CodeEnvironment(bad)
    assert info.value.problems == [
        "timeout_s: must be > 0, got 0",
        "memory_mb: expected int, got str ('big')",
        "stop_strings: expected list[str], got str ('x')",
        "num_worker: unknown option. Did you mean 'num_workers'?",
    ]
    with pytest.raises(ConfigError) as info:
        CodeEnvironment({"max_turns": 0, "stop_strings": [], "sandbox_user": ""})
    assert info.value.problems == [
        "sandbox_user: must have at least 1 character, got ''",
        "max_turns: must be >= 1, got 0",
        "stop_strings: must have at least 1 item, got []",
    ]


def test_metrics(env):
    batch = BatchedDataDict(
        total_reward=torch.tensor([1.0, 0.5, 0.0, 1.0]),
        extra_env_info=[{"turns": 2}, {"turns": 1}, None, {"turns": 3}],
    )
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics == {
        "code_env/mean_reward": 0.625,
        "code_env/all_tests_passed_rate": 0.5,
        "code_env/mean_code_turns": 1.5,
        "code_env/over_max_parse_chars": 0,
    }


LOGS = [conversation("<code>print(6 * 7)</code>"), conversation("no code")]
METADATA = [{"tests": ["assert True"]}, {"tests": ["assert True"]}]


def test_check_env_in_process(env):
    ret = check_env(env, LOGS, METADATA)
    assert ret.observations[0]["content"] == "<result>\n42\n</result>"
    assert ret.rewards.tolist() == [0.0, 0.0]


@pytest.mark.ray
def test_check_env_on_a_ray_actor(ray_session):
    actor = ray_session.remote(CodeEnvironment).options(num_cpus=0).remote(CFG)
    try:
        ret = check_env(actor, LOGS, METADATA)
        assert ret.observations[0]["content"] == "<result>\n42\n</result>"
        assert ret.terminateds.tolist() == [False, True]
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


def test_multi_turn_rollout_stops_at_code_and_keeps_state(tiny_tokenizer, env):
    script = [
        "<code>x = 20</code> this tail is cut by the stop string",
        "<code>print(x + 1)\nx * 2</code>",
        "Done: x is 20.",
    ]
    policy = ScriptedGeneration(tiny_tokenizer, lambda p: script[min(p.count("<result>"), 2)])
    sample = {
        "task": "code",
        "prompt": "Set x to 20 using Python.",
        "metadata": {"tests": ["assert x == 20", "assert x == 21"]},
        "stop_strings": ["</code>"],
    }
    batch = make_batch(tiny_tokenizer, [sample])
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"code": env}, 512)
    log = final["message_log"][0]
    assert [m["role"] for m in log] == [
        "user", "assistant", "tool", "assistant", "tool", "assistant", "environment",
    ]  # fmt: skip
    assert [m["content"] for m in log[1:]] == [
        "<code>x = 20</code>", "<result>\n</result>",
        "<code>print(x + 1)\nx * 2</code>", "<result>\n21\n40\n</result>",
        "Done: x is 20.", f"{NO_CODE}: 1/2 tests passed.",
    ]  # fmt: skip
    assert policy.calls == [[["</code>"]], [["</code>"]], [["</code>"]]]
    assert final["turn_rewards"] == [[0.0, 0.0, 0.5]]
    assert final["total_reward"].tolist() == [0.5]
    assert final["extra_env_info"][0]["cells"] == ["x = 20", "print(x + 1)\nx * 2"]


def test_a_batch_keeps_its_order(env):
    ret = step(env, [f"<code>{i} * 3</code>" for i in range(5)], [None] * 5)
    assert [o["content"] for o in ret.observations] == [
        f"<result>\n{i * 3}\n</result>" for i in range(5)
    ]


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"
ADVERSARIAL = ["<code>" * 200_000, "```python\n" * 120_000, "<code>print(1)" * 80_000]


def unscored(why: str) -> dict[str, str]:
    return {
        "role": "environment",
        "content": f"Not scored, so the episode ends with reward 0: {why}.",
    }


def test_megabyte_responses_over_the_default_cap_are_not_run(env):
    responses = ["<code>print(6 * 7)</code>", *ADVERSARIAL]
    ret = step(env, responses, [{"tests": TESTS}] * 4)
    reasons = [
        f"response has 1,200,000 characters, {OVER_CAP}",
        f"response has 1,200,000 characters, {OVER_CAP}",
        f"response has 1,120,000 characters, {OVER_CAP}",
    ]
    assert ret.observations == [
        {"role": "tool", "content": "<result>\n42\n</result>"},
        *[unscored(why) for why in reasons],
    ]
    assert ret.metadata[1:] == [{"tests": TESTS, "code_error": why} for why in reasons]
    assert ret.rewards.tolist() == [0.0] * 4
    assert ret.terminateds.tolist() == [False, True, True, True]
    assert ret.answers == ["print(6 * 7)", None, None, None]
    batch = BatchedDataDict(
        message_log=[conversation(r) for r in responses],
        extra_env_info=ret.metadata,
        total_reward=ret.rewards,
    )
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["code_env/over_max_parse_chars"] == 3


def test_a_megabyte_response_under_the_default_cap_runs():
    env = CodeEnvironment({**CFG, "num_workers": 1})
    response = "Let me think. " * 20_000 + "<code>" + "x = 1\n" * 100_000 + "print(x + 1)</code>"
    assert len(response) == 880_025
    try:
        ret = step(env, [response], [{}])
    finally:
        env.shutdown()
    assert ret.observations == [{"role": "tool", "content": "<result>\n2\n</result>"}]
    assert ret.metadata[0]["turns"] == 1 and "code_error" not in ret.metadata[0]


def test_responses_up_to_the_cap_are_run_and_longer_ones_are_not():
    env = CodeEnvironment({**CFG, "num_workers": 1, "max_parse_chars": 3_000})
    noise = "```python\n" * 297 + "x" * 9  # 2,979 characters
    at_cap, over = f"{noise}<code>print(2)</code>", f"{noise}!<code>print(2)</code>"
    assert (len(at_cap), len(over)) == (3_000, 3_001)
    try:
        ret = step(env, [at_cap, over], [{}, {}])
    finally:
        env.shutdown()
    assert ret.observations == [
        {"role": "tool", "content": "<result>\n2\n</result>"},
        unscored("response has 3,001 characters, over max_parse_chars=3,000; raise "
                 "max_parse_chars to score it"),
    ]  # fmt: skip


POISONS = {
    "tests_not_a_list": (
        {"tests": "assert True"},
        "tests: expected list[str], got str ('assert True')",
    ),
    "huge_int_test": (
        {"tests": [10**5000]},
        "tests[0]: expected str, got int (an int of about 5001 digits)",
    ),
    "max_turns_str": ({"max_turns": "3"}, "max_turns: expected int, got str ('3')"),
    "cells_nested": (
        {"cells": [{"src": "x = 1"}]},
        "cells[0]: expected str, got dict ({'src': 'x = 1'})",
    ),
    "turns_none": ({"turns": None}, "turns: expected int, got NoneType (None)"),
    "not_a_mapping": (["assert True"], "expected a mapping, got list"),
}


@pytest.mark.parametrize("poison, problem", list(POISONS.values()), ids=list(POISONS))
def test_one_poisoned_sample_fails_alone_and_the_others_are_scored(env, poison, problem):
    finished = {"tests": TESTS, "cells": ["def square(n):\n    return n * n"], "turns": 1}
    responses = ["<code>print(6 * 7)</code>", "<code>print(1)</code>", "Done."]
    ret = step(env, responses, [{}, poison, finished])
    assert ret.rewards.tolist() == [0.0, 0.0, torch.tensor(2 / 3).item()]
    assert ret.terminateds.tolist() == [False, True, True]
    assert ret.observations[0]["content"] == "<result>\n42\n</result>"
    assert ret.observations[2]["content"] == f"{NO_CODE}: 2/3 tests passed."
    # The poisoned sample fails through `errors` (the rollout records it, loss_multiplier 0),
    # before any of its code runs; its metadata comes back unchanged.
    assert ret.errors[0] is None and ret.errors[2] is None
    assert ret.errors[1].startswith(
        f"CodeEnvironment.step_sample raised ValueError: metadata: {problem}\nTraceback"
    )
    assert ret.metadata[1] is poison
