"""MathEnvironment: exact rewards from real math-verify in real worker processes, timeouts
and dead or stuck workers that fail only their own samples (diagnostics in metadata and
metrics, never in the observation), the multiple-choice and DAPO verifiers, the multi-reward
mode and MathMultiRewardEnvironment, config errors, the contract checker (in-process and as a
Ray actor) and rollouts."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.checker import check_env
from envloop.environments.common.math_verification import math_equivalent
from envloop.environments.common.process_pool import Outcome
from envloop.environments.math.checks import STRING_CHECKS
from envloop.environments.math.config import checker_name
from envloop.environments.math.multichoice_answers import grade_choice
from envloop.environments.math_environment import (
    DEFAULTS,
    MathEnvironment,
    MathMultiRewardEnvironment,
    _select_extracted_answer,
)
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch

# Checks that must finish get a generous limit (after the workers' warm-up a check takes
# milliseconds, but a loaded machine can stall a process for seconds); the tests that expect
# a timeout use SHORT_TIMEOUT_S with an answer no limit can fit (PATHOLOGICAL) or a stopped
# worker, next to one-digit answers.
TIMEOUT_S = 30.0
SHORT_TIMEOUT_S = 2.0
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"
CORRECT = "Environment: correct"
INCORRECT = "Environment: incorrect"

# (ground truth, response, correct?)
CASES = [
    ("1/2", r"so the answer is \boxed{0.5}", True),
    ("1/2", r"\boxed{\frac{2}{4}}", True),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", True),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\sin(\pi/3)}", True),
    ("[1, 2)", r"\boxed{[1,2)}", True),
    (3, r"\boxed{3}", True),  # numeric ground truths are compared as text
    ("3", "The answer is 3", True),  # math-verify also reads an unboxed final expression
    ("3", r"\boxed{4}", False),
    ("3", r"\boxed{3} or \boxed{4}", False),
    ("3", "The answer is 4", False),
    ("3", "asdf qwer !!", False),
    ("3", r"\boxed{3", False),
    ("3", r"\boxed{}", False),
    ("3", "", False),
]


def logs(*responses):
    return [
        [{"role": "user", "content": "Solve it."}, {"role": "assistant", "content": r}]
        for r in responses
    ]


def truths(*values):
    return [{"ground_truth": v} for v in values]


@pytest.fixture(scope="module")
def env():
    env = MathEnvironment({"verify_timeout_s": TIMEOUT_S})
    yield env
    env.shutdown()


@pytest.fixture(scope="module")
def short_env():
    env = MathEnvironment({"verify_timeout_s": SHORT_TIMEOUT_S})
    yield env
    env.shutdown()


@pytest.fixture(scope="module")
def multi_env():
    env = MathEnvironment({"num_workers": 1, "verify_timeout_s": TIMEOUT_S, "reward_mode": "multi"})
    yield env
    env.shutdown()


def test_rewards_and_observations_are_exact(env):
    ret = env.step(logs(*[c[1] for c in CASES]), truths(*[c[0] for c in CASES]))
    expected = [float(c[2]) for c in CASES]
    assert ret.rewards.dtype == torch.float32
    assert ret.rewards.tolist() == expected
    assert [o["content"] for o in ret.observations] == [
        CORRECT if c[2] else INCORRECT for c in CASES
    ]
    assert {o["role"] for o in ret.observations} == {"environment"}
    assert ret.terminateds.tolist() == [True] * len(CASES)
    assert ret.next_stop_strings == [None] * len(CASES)
    # The answers are the text math-verify read, after its LaTeX normalisation (0.5 reads 1/2).
    assert ret.answers[:3] == [r"\frac{1}{2}", r"\frac{2}{4}", "(x+1)^2"]
    assert ret.answers[-4:] == [None, None, None, None]


def test_metadata_comes_back_unchanged(env):
    metadata = [{"ground_truth": "7", "source": "gsm8k", "id": 12}]
    ret = env.step(logs(r"\boxed{7}"), metadata)
    assert ret.metadata == [{"ground_truth": "7", "source": "gsm8k", "id": 12}]


def test_unscorable_samples_get_zero_and_say_why_in_metadata_only(env):
    batch = [
        *logs(r"\boxed{1}", r"\boxed{1}", r"\boxed{1}", r"\boxed{1}"),
        [{"role": "user", "content": "no answer at all"}],
        [{"role": "assistant", "content": ["not", "text"]}],
    ]
    metadata = [None, {}, {"ground_truth": None}, {"ground_truth": ["1"]}, *truths("1", "1")]
    ret = env.step(batch, metadata)
    assert ret.rewards.tolist() == [0.0] * 6
    assert [o["content"] for o in ret.observations] == [INCORRECT] * 6
    why = {"verification_error": "no ground_truth in this sample's metadata"}
    not_text = "ground_truth must be a string or a number, got list"
    assert ret.metadata == [
        why,
        why,
        {"ground_truth": None, **why},
        {"ground_truth": ["1"], "verification_error": not_text},
        {"ground_truth": "1"},
        {"ground_truth": "1"},
    ]
    assert ret.terminateds.tolist() == [True] * 6
    assert ret.answers == [None] * 6


def test_pathological_answer_times_out_alone(short_env):
    before = short_env.pool.replaced
    responses = [rf"\boxed{{{i if i % 3 else i + 1}}}" for i in range(24)]  # 1 ms checks
    expected = [float(math_equivalent((str(i), r))) for i, r in enumerate(responses)]
    responses[5], expected[5] = PATHOLOGICAL, 0.0
    ret = short_env.step(logs(*responses), truths(*range(24)))
    assert ret.rewards.tolist() == expected
    assert sum(expected) == 15.0
    assert ret.observations[5]["content"] == INCORRECT
    error = f"TimeoutError: timed out after {SHORT_TIMEOUT_S} s"
    assert ret.metadata[5] == {"ground_truth": 5, "verification_error": error}
    assert ret.metadata[:5] + ret.metadata[6:] == truths(*range(5), *range(6, 24))
    assert ret.answers[5] is None and ret.answers[4] == "4"
    # The check was interrupted inside its worker, which goes on: nothing was replaced.
    assert short_env.pool.replaced == before
    batch = BatchedDataDict(
        message_log=logs(*responses), total_reward=ret.rewards, extra_env_info=ret.metadata
    )
    _, metrics = short_env.global_post_process_and_metrics(batch)
    assert (metrics["math_env/timeouts"], metrics["math_env/verification_errors"]) == (1, 1)


def test_a_later_attempt_clears_an_earlier_verification_error(env):
    stale = {"ground_truth": "4", "verification_error": "TimeoutError: timed out after 1.0 s"}
    ret = env.step(logs(r"\boxed{4}", r"\boxed{5}"), [stale, {**stale, "id": 3}])
    assert ret.metadata == [{"ground_truth": "4"}, {"ground_truth": "4", "id": 3}]
    assert stale["verification_error"]  # the input is not mutated


def _eight_samples():
    values = list(range(8))
    return logs(*[rf"\boxed{{{v}}}" for v in values]), truths(*values)


def test_a_crashed_worker_is_replaced(env):
    before = env.pool.replaced
    worker = env.pool._workers[0].process
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    ret = env.step(*_eight_samples())
    assert ret.rewards.tolist() == [1.0] * 8
    assert env.pool.replaced == before + 1


def test_a_stuck_worker_is_killed_and_only_its_sample_fails(short_env):
    before = short_env.pool.replaced
    os.kill(short_env.pool._workers[0].process.pid, signal.SIGSTOP)  # deaf even to the alarm
    ret = short_env.step(*_eight_samples())  # sample 0 goes to the stopped worker
    assert ret.rewards.tolist() == [0.0] + [1.0] * 7
    assert ret.observations[0]["content"] == INCORRECT
    assert ret.metadata[0] == {
        "ground_truth": 0,
        "verification_error": f"timed out after {2 * SHORT_TIMEOUT_S} s",
    }
    assert short_env.pool.replaced == before + 1
    assert short_env.step(*_eight_samples()).rewards.tolist() == [1.0] * 8


def test_multi_reward_components_are_exact(multi_env):
    responses = [r"\boxed{0.5}", r"\boxed{3} or \boxed{4}", "The answer is 3", r"\boxed{7}", ""]
    ret = multi_env.step(logs(*responses), truths("1/2", "3", "3", "3", "3"))
    assert set(ret.rewards) == {"reward/correctness", "reward/format"}
    assert ret.rewards["reward/correctness"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert ret.rewards["reward/format"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]


def test_metrics_are_exact(env):
    ret = env.step(logs(r"\boxed{2}", "2", r"\boxed{5}", "no idea"), truths(2, 2, 2, 2))
    batch = BatchedDataDict(
        message_log=logs(r"\boxed{2}", "2", r"\boxed{5}", "no idea"), total_reward=ret.rewards
    )  # no extra_env_info: no verification errors to count
    out, metrics = env.global_post_process_and_metrics(batch)
    assert out is batch
    assert metrics == {
        "math_env/accuracy": 0.5,
        "math_env/num_samples": 4,
        "math_env/fraction_boxed": 0.5,
        "math_env/mean_attempts": 1.0,
        "math_env/timeouts": 0,
        "math_env/verification_errors": 0,
        "math_env/over_max_parse_chars": 0,
    }


def test_config_errors_name_every_bad_key():
    with pytest.raises(ConfigError) as info:
        MathEnvironment(
            {
                "num_worker": 2,
                "verify_timeout_s": 0,
                "reward_mode": "both",
                "stop_strings": ["</answer>", 3],
            }
        )
    assert info.value.problems == [
        "verify_timeout_s: must be > 0, got 0",
        "stop_strings[1]: expected str, got int (3)",
        "reward_mode: 'both' is not one of correctness, multi",
        "num_worker: unknown option. Did you mean 'num_workers'?",
    ]
    with pytest.raises(ConfigError) as info:
        MathEnvironment(
            {"num_workers": 0, "verify_timeout_s": "10", "max_attempts": 0, "observation_role": ""}
        )
    assert info.value.problems == [
        "num_workers: must be >= 1, got 0",
        "verify_timeout_s: expected number, got str ('10')",
        "max_attempts: must be >= 1, got 0",
        "observation_role: must have at least 1 character, got ''",
    ]
    with pytest.raises(ConfigError, match="expected a mapping, got list"):
        MathEnvironment([("num_workers", 2)])  # type: ignore[arg-type]


def test_defaults():
    assert DEFAULTS == {
        "num_workers": 2,
        "verify_timeout_s": 10.0,
        "stop_strings": None,
        "reward_mode": "correctness",
        "max_attempts": 1,
        "observation_role": "environment",
        "verifier_type": "math",
        "math_verify_impl": "hf_math_verify",
        "max_parse_chars": 1_000_000,
    }


def test_check_env_in_process(env, multi_env):
    samples, metadata = logs(r"\boxed{0.5}", "x", ""), truths("1/2", "1", "2")
    assert check_env(env, samples, metadata).rewards.tolist() == [1.0, 0.0, 0.0]
    multi = check_env(multi_env, samples, metadata).rewards
    assert multi["reward/format"].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.ray
def test_check_env_as_a_ray_actor(ray_session):
    actor = ray_session.remote(MathEnvironment).options(num_cpus=0).remote({"num_workers": 1})
    try:
        ret = check_env(actor, logs(r"\boxed{0.5}", r"\boxed{2}"), truths("1/2", "3"))
        assert ret.rewards.tolist() == [1.0, 0.0]
        assert [o["content"] for o in ret.observations] == [CORRECT, INCORRECT]
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


QUESTIONS = {"Half as a decimal?": r"It is \boxed{0.5}", "Two plus two?": r"\boxed{5}"}


def _respond(prompt: str) -> str:
    return next(answer for question, answer in QUESTIONS.items() if question in prompt)


def test_rollout_rewards_land_in_total_reward(env, multi_env, tiny_tokenizer):
    samples = [
        {"task": "math", "prompt": "Half as a decimal?", "metadata": {"ground_truth": "1/2"}},
        {"task": "math", "prompt": "Two plus two?", "metadata": {"ground_truth": "4"}},
    ]
    policy = ScriptedGeneration(tiny_tokenizer, _respond)
    batch = make_batch(tiny_tokenizer, samples)
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"math": env}, 256)
    assert final["total_reward"].tolist() == [1.0, 0.0]
    assert final["num_turns"].tolist() == [1, 1]
    assert [log[-1]["content"] for log in final["message_log"]] == [CORRECT, INCORRECT]
    _, metrics = env.global_post_process_and_metrics(final)
    assert metrics["math_env/accuracy"] == 0.5
    assert metrics["math_env/fraction_boxed"] == 1.0

    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"math": multi_env}, 256)
    assert final["total_reward"].tolist() == [2.0, 1.0]
    assert final["reward/correctness"].tolist() == [1.0, 0.0]
    assert final["reward/format"].tolist() == [1.0, 1.0]
    assert multi_env.global_post_process_and_metrics(final)[1]["math_env/accuracy"] == 0.5


def test_max_attempts_retries_after_incorrect_until_right_or_out_of_attempts(tiny_tokenizer):
    """A policy that answers 5, then 4, then 4: the first question is right on its second
    try, the second (truth 7) uses all three attempts; every verdict is in the log."""
    samples = [
        {"task": "math", "prompt": "Two plus two?", "metadata": {"ground_truth": "4"}},
        {"task": "math", "prompt": "Three plus four?", "metadata": {"ground_truth": "7"}},
    ]

    def respond(conversation: str) -> str:
        return r"\boxed{5}" if conversation.count(INCORRECT) == 0 else r"\boxed{4}"

    env = MathEnvironment({"num_workers": 1, "max_attempts": 3, "observation_role": "user"})
    try:
        batch = make_batch(tiny_tokenizer, samples)
        policy = ScriptedGeneration(tiny_tokenizer, respond)
        final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"math": env}, 256, 5)
        assert final["total_reward"].tolist() == [1.0, 0.0]
        assert final["num_turns"].tolist() == [2, 3]
        assert list(final["turn_rewards"]) == [[0.0, 1.0], [0.0, 0.0, 0.0]]
        verdicts = [[m["content"] for m in log[2:] if m["role"] == "user"]
                    for log in final["message_log"]]  # fmt: skip
        assert verdicts == [[INCORRECT, CORRECT], [INCORRECT] * 3]
        _, metrics = env.global_post_process_and_metrics(final)
        assert (metrics["math_env/accuracy"], metrics["math_env/mean_attempts"]) == (0.5, 2.5)
    finally:
        env.shutdown()


MULTICHOICE_RESPONSES = [
    "B is wrong because...\nAnswer: C",
    "**Answer:** (b)",  # a lower-case letter is not a choice
    "答案：Ｂ",
    "<think>Answer: A</think>\nAnswer: D",
    "I am not sure.",
]


@pytest.mark.parametrize(
    "verifier_type, rewards, answers",
    [
        ("english_multichoice", [1.0, 0.0, 0.0, 0.0, 0.0], ["C", None, None, "D", None]),
        ("multilingual_multichoice", [1.0, 0.0, 1.0, 0.0, 0.0], ["C", None, "B", "D", None]),
    ],
)
def test_multichoice_verifiers(verifier_type, rewards, answers):
    env = MathEnvironment({"verifier_type": verifier_type})
    metadata = truths("C", "B", "B", "A", "C")
    ret = env.step(logs(*MULTICHOICE_RESPONSES), metadata)
    assert env.verifier is None  # plain string work: no worker processes
    assert ret.rewards.tolist() == rewards
    assert [o["content"] for o in ret.observations] == [
        CORRECT if r else INCORRECT for r in rewards
    ]
    assert ret.answers == answers
    assert ret.metadata == metadata
    assert ret.terminateds.tolist() == [True] * 5


DAPO_RESPONSES = [
    "The total is...\nAnswer: 1,000 dollars",
    r"Answer: $\dfrac12$",
    "Answer: 0.5",  # text comparison: 0.5 is not \frac{1}{2}
    r"<think>Answer: 7</think>The answer is \boxed{7}.",  # no answer line after thinking
]


@pytest.mark.parametrize(
    "config",
    [{"verifier_type": "dapo"}, {"verifier_type": "math", "math_verify_impl": "dapo_math_verify"}],
)
def test_dapo_verifier_both_ways_of_selecting_it(config):
    env = MathEnvironment(config)
    ret = env.step(logs(*DAPO_RESPONSES), truths("1000", r"\frac{1}{2}", r"\frac{1}{2}", "7"))
    assert env.checker == "dapo_math_verify" and env.verifier is None
    assert ret.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert ret.answers == ["1000", r"\frac{1}{2}", "0.5", None]
    assert [o["content"] for o in ret.observations] == [CORRECT, CORRECT, INCORRECT, INCORRECT]
    assert env.check([("3", "Answer: 3"), ("3", "Answer: 4")]) == [
        Outcome(value=True),
        Outcome(value=False),
    ]


def test_an_in_process_check_that_raises_fails_only_its_sample(monkeypatch):
    def check(truth, response):
        if "boom" in response:
            raise RuntimeError("no letters here")
        return grade_choice(truth, response)

    monkeypatch.setitem(STRING_CHECKS, "english_multichoice", check)
    env = MathEnvironment({"verifier_type": "english_multichoice"})
    ret = env.step(logs("Answer: A", "boom"), truths("A", "A"))
    assert ret.rewards.tolist() == [1.0, 0.0]
    assert [o["content"] for o in ret.observations] == [CORRECT, INCORRECT]
    error = "RuntimeError: no letters here"
    assert ret.metadata[1] == {"ground_truth": "A", "verification_error": error}


def test_return_extracted_answer_is_accepted_and_answers_are_one_per_sample(env):
    responses = [r"The answer is \boxed{42}", "I don't know.", r"\boxed{137}"]
    metadata = truths("42", "42", "42")
    positional = env.step(logs(*responses), metadata, True)
    keyword = env.step(logs(*responses), metadata, return_extracted_answer=True)
    plain = env.step(logs(*responses), metadata)
    for ret in (positional, keyword, plain):
        assert ret.rewards.tolist() == [1.0, 0.0, 0.0]
        assert ret.answers == ["42", None, "137"]


@pytest.mark.parametrize(
    "config, expected",
    [
        ({}, "hf_math_verify"),
        ({"verifier_type": None, "math_verify_impl": None}, "hf_math_verify"),
        ({"verifier_type": "dapo"}, "dapo_math_verify"),
        ({"math_verify_impl": "dapo_math_verify"}, "dapo_math_verify"),
        ({"verifier_type": "english_multichoice"}, "english_multichoice"),
        ({"verifier_type": "multilingual_multichoice"}, "multilingual_multichoice"),
    ],
)
def test_checker_name(config, expected):
    assert checker_name(config) == expected


def test_verifier_config_errors_list_the_allowed_values():
    with pytest.raises(ConfigError) as info:
        MathEnvironment({"verifier_type": "english_multichoise", "math_verify_impl": "sympy"})
    assert info.value.problems == [
        "verifier_type: 'english_multichoise' is not one of math, english_multichoice, "
        "multilingual_multichoice, dapo. Did you mean 'english_multichoice'?",
        "math_verify_impl: 'sympy' is not one of hf_math_verify, dapo_math_verify",
    ]
    contradictions = {
        "math_verify_impl: 'hf_math_verify' contradicts verifier_type 'dapo'; drop one": {
            "verifier_type": "dapo",
            "math_verify_impl": "hf_math_verify",
        },
        "math_verify_impl: 'dapo_math_verify' applies to verifier_type 'math', not "
        "'english_multichoice'; drop it, or use verifier_type 'dapo'": {
            "verifier_type": "english_multichoice",
            "math_verify_impl": "dapo_math_verify",
        },
        "reward_mode: 'multi' scores one \\boxed{} answer, a math-verify format; it needs "
        "verifier_type 'math' with math_verify_impl 'hf_math_verify'": {
            "verifier_type": "dapo",
            "reward_mode": "multi",
        },
    }
    for problem, config in contradictions.items():
        with pytest.raises(ConfigError) as info:
            MathEnvironment(config)  # type: ignore[arg-type]
        assert info.value.problems == [problem]
    with pytest.raises(ConfigError) as info:
        MathMultiRewardEnvironment({"reward_mode": "correctness"})
    assert info.value.problems == [
        "reward_mode: not an option of math_multi_reward (it has 3 rewards)"
    ]
    with pytest.raises(ConfigError) as info:
        MathMultiRewardEnvironment({"verifier_type": "english_multichoice"})
    assert info.value.problems == [
        "verifier_type: math_multi_reward checks <answer> tags with math-verify only; drop "
        "verifier_type and math_verify_impl"
    ]


@pytest.mark.parametrize(
    "extracted, impl, expected",
    [
        ((["42"], ["137"]), "hf_math_verify", "137"),
        ((["42"], ["7", " 42 "]), "hf_math_verify", "42"),
        ((["42"], []), "hf_math_verify", None),
        ((["42"], [""]), "hf_math_verify", ""),
        ((None, 3), "hf_math_verify", None),  # malformed parts: nothing usable
        ([["a"], ["a"], ["b"]], "hf_math_verify", None),
        (17, "hf_math_verify", None),
        ("137", "dapo_math_verify", "137"),
        (["137"], "dapo_math_verify", None),
    ],
)
def test_select_extracted_answer_is_total(extracted, impl, expected):
    assert _select_extracted_answer(extracted, impl) == expected


@pytest.fixture(scope="module")
def tagged_env():
    env = MathMultiRewardEnvironment({"num_workers": 1, "verify_timeout_s": TIMEOUT_S})
    yield env
    env.shutdown()


TAGGED = [
    # (response, ground truth, correctness, integer, format)
    ("<think>2 + 2 = 4</think>\n<answer>4</answer>", "4", 1.0, 1.0, 1.0),
    ("<think>half</think>\n<answer>0.5</answer>", "1/2", 1.0, 0.0, 1.0),  # by math-verify
    ("<think>3 * 4</think>\n<answer>12.5</answer>", "12", 0.0, 0.0, 1.0),
    ("<think>10 - 5 = 5\n<answer>5</answer>", "5", 1.0, 1.0, 0.0),  # unclosed think
    ("<think>a</think><answer>7</answer>", "7", 1.0, 1.0, 0.0),  # no newline between
    ("<think>a</think>\n<answer>-3</answer>", "-3", 1.0, 0.0, 1.0),  # not non-negative
    ("<think>a</think>\n<answer>1</answer>\n<answer>2</answer>", "2", 1.0, 1.0, 0.0),
    ("<think>a</think>\n<answer> 12 </answer>\n", "12", 1.0, 1.0, 1.0),
    ("<think>a</think>\n<answer>\\boxed{3}</answer>", "3", 1.0, 0.0, 1.0),
    ("4", "4", 0.0, 0.0, 0.0),  # no answer tags: no answer
    ("<think>a</think>\n<answer>x = 1</answer>", "1", 1.0, 0.0, 1.0),
    ("<think>a</think>\n<answer>x^2 = 1</answer>", "1", 0.0, 0.0, 1.0),
]


def test_multi_reward_environment_components_are_exact(tagged_env):
    ret = tagged_env.step(logs(*[t[0] for t in TAGGED]), truths(*[t[1] for t in TAGGED]))
    assert set(ret.rewards) == {"reward/correctness", "reward/integer", "reward/format"}
    assert {v.dtype for v in ret.rewards.values()} == {torch.float32}
    assert ret.rewards["reward/correctness"].tolist() == [t[2] for t in TAGGED]
    assert ret.rewards["reward/integer"].tolist() == [t[3] for t in TAGGED]
    assert ret.rewards["reward/format"].tolist() == [t[4] for t in TAGGED]
    assert [o["content"] for o in ret.observations] == [
        CORRECT if t[2] else INCORRECT for t in TAGGED
    ]
    assert ret.answers[:4] == ["4", r"\frac{1}{2}", "12.5", "5"]
    assert ret.answers[9] is None
    assert ret.metadata == truths(*[t[1] for t in TAGGED])
    assert ret.terminateds.tolist() == [True] * len(TAGGED)


def test_multi_reward_environment_in_a_rollout(tagged_env, tiny_tokenizer):
    samples = [
        {"task": "math", "prompt": "Two plus two?", "metadata": {"ground_truth": "4"}},
        {"task": "math", "prompt": "Half?", "metadata": {"ground_truth": "1/2"}},
    ]

    def respond(prompt: str) -> str:
        answer = "4" if "Two" in prompt else "0.4"
        return f"<think>hmm</think>\n<answer>{answer}</answer>"

    policy = ScriptedGeneration(tiny_tokenizer, respond)
    batch = make_batch(tiny_tokenizer, samples)
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"math": tagged_env}, 256)
    assert final["reward/correctness"].tolist() == [1.0, 0.0]
    assert final["reward/integer"].tolist() == [1.0, 0.0]
    assert final["reward/format"].tolist() == [1.0, 1.0]
    assert final["total_reward"].tolist() == [3.0, 1.0]
    _, metrics = tagged_env.global_post_process_and_metrics(final)
    assert (metrics["math_env/accuracy"], metrics["math_env/timeouts"]) == (0.5, 0)


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"
ADVERSARIAL = ["\\boxed{" * 300_000, "\\boxed{7}" * 120_000, "{" * 1_000_001]


def test_megabyte_responses_over_the_default_cap_are_not_checked(env):
    responses = [r"\boxed{7}", *ADVERSARIAL]
    ret = env.step(logs(*responses), truths(7, 7, 7, 7))
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [o["content"] for o in ret.observations] == [CORRECT] + [INCORRECT] * 3
    reasons = [
        f"response has 2,100,000 characters, {OVER_CAP}",
        f"response has 1,080,000 characters, {OVER_CAP}",  # right, but over the cap
        f"response has 1,000,001 characters, {OVER_CAP}",
    ]
    assert ret.metadata == [
        {"ground_truth": 7},
        *[{"ground_truth": 7, "verification_error": why} for why in reasons],
    ]
    assert ret.answers == ["7", None, None, None]
    assert ret.terminateds.tolist() == [True] * 4
    batch = BatchedDataDict(
        message_log=logs(*responses), total_reward=ret.rewards, extra_env_info=ret.metadata
    )
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["math_env/over_max_parse_chars"] == 3
    assert metrics["math_env/verification_errors"] == 3
    assert metrics["math_env/fraction_boxed"] == 0.25  # the responses over the cap are not read


def test_megabyte_responses_under_the_default_cap_are_checked_exactly(env):
    """Just under the cap, a megabyte of unclosed braces before the answer is read in one pass
    (unfinished thinking still gives no answer)."""
    responses = [
        "\\boxed{" * 140_000 + r"\boxed{7}",
        "{" * 990_000 + r" so \boxed{7}",
        "<think>" * 140_000 + r"\boxed{7}",
    ]
    assert all(980_000 <= len(r) < 1_000_000 for r in responses)
    ret = env.step(logs(*responses), truths(7, 7, 7))
    assert ret.rewards.tolist() == [1.0, 1.0, 0.0]
    assert ret.answers == ["7", "7", None]
    assert [md.get("verification_error") for md in ret.metadata] == [None, None, None]


def test_every_reward_component_of_a_response_over_the_cap_is_zero(multi_env, tagged_env):
    ret = multi_env.step(logs(r"\boxed{7}", "\\boxed{7}" * 120_000), truths("7", "7"))
    assert ret.rewards["reward/correctness"].tolist() == [1.0, 0.0]
    assert ret.rewards["reward/format"].tolist() == [1.0, 0.0]
    over = "<think>a</think>\n<answer>7</answer>" + " " * 1_000_000
    ret = tagged_env.step(logs("<think>a</think>\n<answer>7</answer>", over, "<answer>" * 200_000),
                          truths("7", "7", "7"))  # fmt: skip
    assert {name: r.tolist() for name, r in ret.rewards.items()} == {
        "reward/correctness": [1.0, 0.0, 0.0],
        "reward/integer": [1.0, 0.0, 0.0],
        "reward/format": [1.0, 0.0, 0.0],
    }
    assert ret.metadata[1]["verification_error"] == f"response has 1,000,035 characters, {OVER_CAP}"
    assert ret.metadata[2]["verification_error"] == f"response has 1,600,000 characters, {OVER_CAP}"


def test_texts_up_to_the_cap_are_checked_and_longer_ones_are_not():
    env = MathEnvironment(
        {"num_workers": 1, "verify_timeout_s": TIMEOUT_S, "max_parse_chars": 2_000}
    )
    try:
        noise = "Let me think. " * 142  # 1,988 characters
        at_cap, over = f"{noise}So \\boxed{{7}}", f"{noise}So, \\boxed{{7}}"
        assert (len(at_cap), len(over)) == (2_000, 2_001)
        metadata = [*truths(7, 7, 7), {"ground_truth": "7" + " " * 2_000}]
        ret = env.step(logs(at_cap, over, r"\boxed{7}", r"\boxed{7}"), metadata)
    finally:
        env.shutdown()
    assert ret.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    cap = "over max_parse_chars=2,000; raise max_parse_chars to score it"
    assert [md.get("verification_error") for md in ret.metadata] == [
        None,
        f"response has 2,001 characters, {cap}",
        None,
        f"ground_truth has 2,001 characters, {cap}",
    ]


HUGE_INT = (
    "ground_truth cannot be written as text: ValueError: Exceeds the limit (4300 digits) for "
    "integer string conversion; use sys.set_int_max_str_digits() to increase the limit"
)
POISONS = {
    "huge_int": ({"ground_truth": 10**5000}, HUGE_INT),
    "nested": (
        {"ground_truth": {"value": "7"}},
        "ground_truth must be a string or a number, got dict",
    ),
    "list": ({"ground_truth": ["7"]}, "ground_truth must be a string or a number, got list"),
    "bool": ({"ground_truth": True}, "ground_truth must be a string or a number, got bool"),
    "none": ({"ground_truth": None}, "no ground_truth in this sample's metadata"),
    "missing": ({"answer": "7"}, "no ground_truth in this sample's metadata"),
}


@pytest.mark.parametrize("poison, why", list(POISONS.values()), ids=list(POISONS))
def test_one_poisoned_sample_scores_zero_and_the_others_are_checked(env, poison, why):
    """Issue 15: a ground truth of 10**5000 raised in step, and the correct \\boxed{7} in
    the same call got no result."""
    responses = [r"\boxed{7}", r"\boxed{7}", r"\boxed{0.5}", r"\boxed{3}"]
    metadata = [{"ground_truth": "7"}, poison, {"ground_truth": "1/2"}, {"ground_truth": 4}]
    ret = env.step(logs(*responses), metadata)
    assert ret.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [o["content"] for o in ret.observations] == [CORRECT, INCORRECT, CORRECT, INCORRECT]
    assert ret.metadata[1] == {**poison, "verification_error": why}
    assert [ret.metadata[i] for i in (0, 2, 3)] == [metadata[i] for i in (0, 2, 3)]
    assert ret.answers == ["7", None, r"\frac{1}{2}", "3"]


def test_a_poisoned_ground_truth_in_math_multi_reward(tagged_env):
    good = "<think>2 + 2</think>\n<answer>4</answer>"
    ret = tagged_env.step(logs(good, good, good), truths("4", 10**5000, "4"))
    assert {name: r.tolist() for name, r in ret.rewards.items()} == {
        "reward/correctness": [1.0, 0.0, 1.0],
        "reward/integer": [1.0, 1.0, 1.0],  # the format rewards read the response only
        "reward/format": [1.0, 1.0, 1.0],
    }
    assert ret.metadata[1]["verification_error"] == HUGE_INT


def test_an_unusable_sample_ends_its_episode_whatever_max_attempts_says():
    config = {"verifier_type": "english_multichoice", "max_attempts": 3, "max_parse_chars": 100}
    env = MathEnvironment(config)  # type: ignore[arg-type]
    batch = [*logs("Answer: B", "Answer: A", "Answer: A" + " " * 100), ["not a message"], None]
    metadata = truths("A", 10**5000, "A", "A", "A")
    ret = env.step(batch, metadata)
    assert ret.rewards.tolist() == [0.0] * 5
    # A wrong answer may try again; a bad ground truth or a response over the cap may not.
    assert ret.terminateds.tolist() == [False, True, True, False, False]
    assert ret.metadata[1]["verification_error"] == HUGE_INT
    assert ret.metadata[2]["verification_error"] == (
        "response has 109 characters, over max_parse_chars=100; raise max_parse_chars to score it"
    )
