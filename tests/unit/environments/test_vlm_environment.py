"""The ``vlm`` environment: config validation, exact rewards and observations, metrics, the
contract check in-process and as a Ray actor, and a rollout through the engine."""

from __future__ import annotations

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments import check_env
from envloop.environments.registry import create_env, register_env
from envloop.environments.vlm_environment import (
    DEFAULT_CONFIG,
    VLMEnvironment,
    VLMVerifyWorker,
    validated_config,
)
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch

CUSTOM = "tests.fixtures.custom_rewards"
LOGS = [
    [
        {"role": "user", "content": "What color is the cube?"},
        {"role": "assistant", "content": "<think>It is red.</think><answer>Red</answer>"},
    ],
    [
        {"role": "user", "content": "How many spheres?"},
        {"role": "assistant", "content": "<answer>3</answer>"},
    ],
    [
        {"role": "user", "content": "Where is the cone?"},
        {"role": "assistant", "content": "I cannot tell."},
    ],
]
METADATA = [{"ground_truth": "red"}, {"ground_truth": "4"}, {"ground_truth": "left"}]


@pytest.fixture
def make_env():
    """Builds environments and shuts them all down after the test (their verify workers are
    Ray actors when an earlier test started the shared Ray session)."""
    envs = []

    def make(cfg=None):
        envs.append(VLMEnvironment(cfg))
        return envs[-1]

    yield make
    for env in envs:
        env.shutdown()


@pytest.fixture(scope="module")
def env():
    """The default environment, shared by the tests that only step it."""
    env = VLMEnvironment()
    yield env
    env.shutdown()


def contents(observations):
    return [o["content"] for o in observations]


def test_none_means_the_defaults():
    assert validated_config(None) == DEFAULT_CONFIG
    assert validated_config({"num_workers": 3})["reward_functions"] == [
        {"name": "format", "weight": 0.2},
        {"name": "exact_alnum", "weight": 0.8},
    ]


def test_config_errors_list_every_problem():
    with pytest.raises(ConfigError) as info:
        VLMEnvironment(
            {
                "num_worker": 2,
                "stop_strings": ["</answer>", ""],
                "reward_functions": [
                    {"name": "exact_alnun", "weight": 1},
                    {"name": "format", "weight": 0, "kwargs": {"think_tag": 1}},
                    {"weight": 1, "kwargs": "x"},
                ],
            }
        )
    problems = info.value.problems
    assert problems[0] == "stop_strings[1]: must have at least 1 character, got ''"
    assert problems[1] == "num_worker: unknown option. Did you mean 'num_workers'?"
    assert problems[2].startswith("reward_functions[0].name: No reward function named ")
    assert "Did you mean 'exact_alnum'?" in problems[2]
    assert problems[3:] == [
        "reward_functions[1].weight: must be > 0, got 0",
        "reward_functions[1].kwargs.think_tag: expected str, got int (1)",
        "reward_functions[2].name: required",
        "reward_functions[2].kwargs: expected dict, got str ('x')",
    ]
    assert str(info.value).startswith("Invalid VLMEnvConfig:\n  - stop_strings[1]: must have")


def test_config_types_and_ranges():
    with pytest.raises(ConfigError) as info:
        VLMEnvironment({"num_workers": 0, "stop_strings": "</answer>", "reward_functions": []})
    assert info.value.problems == [
        "num_workers: must be >= 1, got 0",
        "stop_strings: expected list[str] | None, got str ('</answer>')",
        "reward_functions: expected a non-empty list of {'name', 'weight', 'kwargs'?} dicts",
    ]
    with pytest.raises(ConfigError, match="VLMEnvConfig:\n  - expected a mapping, got list"):
        VLMEnvironment([("num_workers", 1)])


def test_verify_worker_returns_mixed_scores():
    worker = VLMVerifyWorker()
    responses = [log[-1]["content"] for log in LOGS]
    assert worker.verify(responses, ["red", "4", "left"]) == pytest.approx([1.0, 0.1, 0.0])


def test_step_scores_the_last_assistant_message(env):
    ret = check_env(env, LOGS, METADATA)
    assert ret.rewards.dtype == torch.float32
    assert ret.rewards.tolist() == pytest.approx([1.0, 0.1, 0.0])  # 0.2 format + 0.8 exact
    assert ret.terminateds.tolist() == [True, True, True]
    assert ret.next_stop_strings == [None, None, None]
    assert ret.answers == ["Red", "3", "I cannot tell."]
    assert contents(ret.observations) == [
        "Environment: correct",
        "Environment: incorrect",
        "Environment: incorrect (no <answer>...</answer> in the response)",
    ]
    assert {o["role"] for o in ret.observations} == {"environment"}
    assert ret.metadata[1] == {
        "ground_truth": "4", "correct": False, "reward": pytest.approx(0.1), "reward_errors": [],
    }  # fmt: skip


def test_malformed_inputs_score_zero_and_say_why(env):
    logs = [
        [{"role": "user", "content": "hi"}],  # no assistant message at all
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>b</answer>"}]}],
        [{"role": "assistant", "content": "<answer>b</answer>"}],
    ]
    ret = env.step(logs, [{"ground_truth": "b"}, {"ground_truth": "B"}, {"answer": "b"}])
    assert ret.rewards.tolist() == pytest.approx([0.0, 0.9, 0.0])  # multimodal parts are read
    assert contents(ret.observations) == [
        "Environment: incorrect (no <answer>...</answer> in the response)",
        "Environment: correct",
        "Environment: incorrect (metadata: no 'ground_truth' for this sample)",
    ]
    assert ret.metadata[2]["reward_errors"] == ["metadata: no 'ground_truth' for this sample"]


def test_a_failing_custom_reward_is_surfaced_not_raised(make_env):
    env = make_env(
        {
            "reward_functions": [
                {"name": "exact_alnum", "weight": 1},
                {"name": f"{CUSTOM}:explodes_on_boom", "weight": 1},
            ]
        }
    )
    logs = [[{"role": "assistant", "content": f"<answer>{a}</answer>"}] for a in ("x", "boom")]
    ret = env.step(logs, [{"ground_truth": "x"}, {"ground_truth": "boom"}])
    assert ret.rewards.tolist() == [1.0, 0.5]
    error = f"{CUSTOM}:explodes_on_boom: RuntimeError: cannot score '<answer>boom</answer>'"
    assert contents(ret.observations) == [
        "Environment: correct",
        f"Environment: incorrect ({error})",
    ]
    batch = _finished_batch(logs, ret)
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["vlm_env/reward_error_rate"] == 0.5


def test_format_alone_counts_a_full_score_as_correct(make_env):
    env = make_env({"reward_functions": [{"name": "format", "weight": 1}]})
    ret = env.step(LOGS[:2], METADATA[:2])
    assert ret.rewards.tolist() == [1.0, 0.5]
    assert contents(ret.observations) == ["Environment: correct", "Environment: incorrect"]


def test_custom_answer_tag_is_used_for_answers_and_notes(make_env):
    env = make_env(
        {"reward_functions": [{"name": "exact_alnum", "weight": 1, "kwargs": {"answer_tag": "a"}}]}
    )
    logs = [[{"role": "assistant", "content": "<a>7</a>"}], [{"role": "assistant", "content": "8"}]]
    ret = env.step(logs, [{"ground_truth": "7"}, {"ground_truth": "7"}])
    assert ret.answers == ["7", "8"]
    assert contents(ret.observations)[1] == "Environment: incorrect (no <a>...</a> in the response)"


def _finished_batch(logs, ret, **columns):
    return BatchedDataDict(
        message_log=[[*log, obs] for log, obs in zip(logs, ret.observations)],
        extra_env_info=ret.metadata,
        total_reward=ret.rewards,
        **columns,
    )


def test_metrics_in_characters(env):
    ret = env.step(LOGS, METADATA)
    batch = _finished_batch(LOGS, ret)
    out, metrics = env.global_post_process_and_metrics(batch)
    assert out is batch
    lengths = [len(log[-1]["content"]) for log in LOGS]
    assert metrics == {
        "vlm_env/accuracy": pytest.approx(1 / 3),
        "vlm_env/mean_reward": pytest.approx(1.1 / 3),
        "vlm_env/reward_error_rate": 0.0,
        "vlm_env/fraction_properly_ended": pytest.approx(2 / 3),  # the third has no </answer>
        "vlm_env/mean_generation_chars": pytest.approx(sum(lengths) / 3),
        "vlm_env/num_samples": 3.0,
        "vlm_env/over_max_parse_chars": 0.0,
    }


def test_metrics_in_tokens_and_truncation(make_env):
    env = make_env({"stop_strings": ["tell."]})
    logs = [
        [{**m, "token_ids": torch.arange(n)} for m, n in zip(log, (5, k))]
        for log, k in zip(LOGS, (4, 2, 9))
    ]
    ret = env.step(logs, METADATA)
    batch = _finished_batch(logs, ret, truncated=torch.tensor([True, True, False]))
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["vlm_env/mean_generation_tokens"] == 5.0  # (4 + 2 + 9) / 3
    assert "vlm_env/mean_generation_chars" not in metrics
    # 1: ends with </answer>; 2: ends with </answer>; 3: ends with the stop string
    assert metrics["vlm_env/fraction_properly_ended"] == 1.0
    batch["message_log"][0][1]["content"] += " and more"
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["vlm_env/fraction_properly_ended"] == pytest.approx(2 / 3)  # cut off
    batch["truncated"] = torch.tensor([False, True, False])
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["vlm_env/fraction_properly_ended"] == 1.0  # stopped on EOS


def test_metrics_of_an_empty_batch(env):
    empty = BatchedDataDict(message_log=[], extra_env_info=[], total_reward=torch.zeros(0))
    _, metrics = env.global_post_process_and_metrics(empty)
    assert metrics["vlm_env/accuracy"] == 0.0 and metrics["vlm_env/num_samples"] == 0.0


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"
ADVERSARIAL = ["<answer>" * 200_000, "[1, 2, " * 200_000, "<answer>7</answer>" * 60_000]


def answer_logs(*responses):
    return [
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": r}] for r in responses
    ]


def test_megabyte_responses_over_the_default_cap_are_not_parsed(env):
    responses = ["<answer>7</answer>", *ADVERSARIAL]
    ret = env.step(answer_logs(*responses), [{"ground_truth": "7"}] * 4)
    assert ret.rewards.tolist() == pytest.approx([0.9, 0.0, 0.0, 0.0])
    reasons = [
        f"response has 1,600,000 characters, {OVER_CAP}",
        f"response has 1,400,000 characters, {OVER_CAP}",
        f"response has 1,080,000 characters, {OVER_CAP}",  # right, but over the cap
    ]
    assert [md["reward_errors"] for md in ret.metadata] == [[], *[[why] for why in reasons]]
    assert contents(ret.observations) == [
        "Environment: correct",
        *[f"Environment: incorrect ({why})" for why in reasons],
    ]
    assert ret.answers == ["7", None, None, None]
    _, metrics = env.global_post_process_and_metrics(_finished_batch(answer_logs(*responses), ret))
    assert metrics["vlm_env/over_max_parse_chars"] == 3.0
    assert metrics["vlm_env/reward_error_rate"] == 0.75


def test_megabyte_responses_under_the_default_cap_are_scored_exactly(env):
    """Just under the cap, a megabyte of unclosed markup before the answer is read in one pass."""
    responses = [
        "[1, 2, " * 140_000 + "<answer>7</answer>",
        "<answer>" * 124_000 + "</answer> <answer>7</answer>",
        "{" * 990_000 + "<answer>7</answer>",
    ]
    assert all(980_000 <= len(r) < 1_000_000 for r in responses)
    ret = env.step(answer_logs(*responses), [{"ground_truth": "7"}] * 3)
    assert ret.rewards.tolist() == pytest.approx([0.9] * 3)  # as for "<answer>7</answer>" alone
    assert [md["reward_errors"] for md in ret.metadata] == [[], [], []]
    assert ret.answers == ["7", "7", "7"]


def test_texts_up_to_the_cap_are_scored_and_longer_ones_are_not(make_env):
    env = make_env(
        {"reward_functions": [{"name": "bbox_giou", "weight": 1}], "max_parse_chars": 2_000}
    )
    noise = "[1, 2, " * 290  # 2,030 characters
    box = "<answer>[0, 0, 10, 10]</answer>"  # 31
    responses = [noise[:1_969] + box, noise[:1_970] + box, box, box]
    truth = [0, 0, 10, 10]
    metadata = [*[{"ground_truth": truth}] * 3, {"ground_truth": "[0, 0, 10, 10]" + " " * 2_000}]
    ret = env.step(answer_logs(*responses), metadata)
    assert ret.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    cap = "over max_parse_chars=2,000; raise max_parse_chars to score it"
    assert [md["reward_errors"] for md in ret.metadata] == [
        [],
        [f"response has 2,001 characters, {cap}"],
        [],
        [f"ground_truth has 2,014 characters, {cap}"],
    ]


HUGE_INT = (
    "exact_alnum: ValueError: Exceeds the limit (4300 digits) for integer string conversion; "
    "use sys.set_int_max_str_digits() to increase the limit"
)
NO_TRUTH = "metadata: no 'ground_truth' for this sample"
POISONS = {  # metadata: (reward of "<answer>7</answer>", reward_errors)
    "huge_int": ({"ground_truth": 10**5000}, 0.1, [HUGE_INT]),  # format still scores
    "nested": ({"ground_truth": {"answer": "7"}}, 0.1, []),  # read as text: not "7"
    "none": ({"ground_truth": None}, 0.0, [NO_TRUTH]),
    "missing": ({"answer": "7"}, 0.0, [NO_TRUTH]),
    "not_a_mapping": (["7"], 0.0, [NO_TRUTH]),
}


@pytest.mark.parametrize("poison, reward, errors", list(POISONS.values()), ids=list(POISONS))
def test_one_poisoned_sample_is_isolated_and_the_others_are_scored(env, poison, reward, errors):
    responses = ["<answer>7</answer>", "<answer>7</answer>", "<think>t</think><answer>7</answer>"]
    metadata = [{"ground_truth": "7"}, poison, {"ground_truth": 7}]
    ret = env.step(answer_logs(*responses), metadata)
    assert ret.rewards.tolist() == pytest.approx([0.9, reward, 1.0])
    assert [md["reward_errors"] for md in ret.metadata] == [[], errors, []]
    assert [md["correct"] for md in ret.metadata] == [True, False, True]
    if errors:
        assert contents(ret.observations)[1] == f"Environment: incorrect ({errors[0]})"


def test_a_sample_that_is_not_a_message_log_scores_zero_alone(env):
    ret = env.step([*answer_logs("<answer>7</answer>"), None], [{"ground_truth": "7"}] * 2)
    assert ret.rewards.tolist() == pytest.approx([0.9, 0.0])


RAY_CONFIG = {
    "num_workers": 2,
    "reward_functions": [
        {"name": "format", "weight": 1},
        {"name": "exact_alnum", "weight": 2},
        {"name": f"{CUSTOM}:starts_with_truth", "weight": 1, "kwargs": {"ignore_case": True}},
    ],
}


@pytest.mark.ray
def test_ray_verify_workers_split_the_batch(ray_session):
    env = VLMEnvironment(RAY_CONFIG)
    try:
        assert env.workers.remote and len(env.workers.workers) == 2
        ret = check_env(env, LOGS, METADATA)
        # format 1/4, exact 2/4 and starts_with_truth 1/4 ("<think>..." does not start "red")
        assert ret.rewards.tolist() == pytest.approx([0.75, 0.125, 0.0])
        assert contents(ret.observations)[0] == "Environment: incorrect"
    finally:
        env.shutdown()
    assert env.workers.workers == []


@pytest.mark.ray
@pytest.mark.slow
def test_as_a_ray_actor_with_ray_workers_and_math_verify_processes(ray_session):
    register_env("test_vlm", "envloop.environments.vlm_environment:VLMEnvironment", overwrite=True)
    config = {
        "num_workers": 2,
        "reward_functions": [
            {"name": "math_expr", "weight": 2, "kwargs": {"timeout_s": 20.0}},
            {"name": "format", "weight": 1},
            {"name": f"{CUSTOM}:length_share", "weight": 1, "kwargs": {"target": 20}},
        ],
    }
    actor = create_env("test_vlm", config, num_cpus=0)
    try:
        logs = [
            [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            for q, a in [
                ("Half?", "<think>1/2</think><answer>\\frac{1}{2}</answer>"),
                ("Square?", "<answer>(x+1)^2</answer>"),
                ("Two?", "<answer>3</answer>"),
            ]
        ]
        truths = [{"ground_truth": g} for g in ("0.5", "x^2+2x+1", "2")]
        ret = check_env(actor, logs, truths)
        # math 2/4, format 1/4, length_share 1/4 (length / 20, at most 1)
        assert ret.rewards.tolist() == pytest.approx([1.0, 0.875, 0.125 + 0.25 * 18 / 20])
        assert contents(ret.observations) == [
            "Environment: correct", "Environment: correct", "Environment: incorrect",
        ]  # fmt: skip
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


def respond(prompt: str) -> str:
    if "How many spheres?" in prompt:
        return "<think>Two big, one small.</think><answer>3</answer>"
    if "What color is the cube?" in prompt:
        return "<answer>blue</answer>"
    return "Let me describe the whole scene in great detail " * 20


def test_rollout_rewards_reach_total_reward(tiny_tokenizer, env):
    samples = [
        {"task": "vlm", "prompt": "How many spheres?", "metadata": {"ground_truth": "3"}},
        {"task": "vlm", "prompt": "What color is the cube?", "metadata": {"ground_truth": "red"}},
        {"task": "vlm", "prompt": "Describe the scene.", "metadata": {"ground_truth": "x"}},
    ]
    batch = make_batch(tiny_tokenizer, samples)
    policy = ScriptedGeneration(tiny_tokenizer, respond)
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"vlm": env}, max_seq_len=160)
    assert final["total_reward"].tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert final["terminated"].tolist() == [True, True, True]
    assert final["truncated"].tolist() == [False, False, True]  # cut at max_seq_len
    assert final["num_turns"].tolist() == [1, 1, 1]
    assert [log[-1]["content"] for log in final["message_log"][:2]] == [
        "Environment: correct",
        "Environment: incorrect",
    ]
    _, env_metrics = env.global_post_process_and_metrics(final)
    replies = [[m for m in log if m["role"] == "assistant"] for log in final["message_log"]]
    tokens = [sum(len(m["token_ids"]) for m in reply) for reply in replies]
    assert env_metrics["vlm_env/mean_generation_tokens"] == pytest.approx(sum(tokens) / 3)
    assert env_metrics["vlm_env/accuracy"] == pytest.approx(1 / 3)
    assert env_metrics["vlm_env/fraction_properly_ended"] == pytest.approx(2 / 3)
