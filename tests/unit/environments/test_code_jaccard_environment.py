"""CodeJaccardEnvironment: exact token-overlap scores, fenced-code extraction, per-sample
problems, config errors, metrics, the contract checker and a Ray actor."""

from __future__ import annotations

import pytest
import torch

from envloop.config.env_fields import env_config_fields
from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.checker import check_env
from envloop.environments.code.similarity import code_jaccard, code_tokens, extract_code
from envloop.environments.code_jaccard_environment import (
    CodeJaccardEnvConfig,
    CodeJaccardEnvironment,
)

FENCED = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
NO_TRUTH = "no ground_truth string in this sample's metadata"


def _log(response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": response}]


@pytest.fixture(scope="module")
def env():
    return CodeJaccardEnvironment(CodeJaccardEnvConfig(num_workers=2))


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("print('hello')", "print('hello')", 1.0),
        ("return a+b", "return a + b", 1.0),  # layout does not count
        ("x = a + b", "return a + b", 0.5),  # {a, +, b} of {x, =, a, +, b, return}
        ("Print(x)", "print(x)", 0.6),  # case-sensitive: 3 of 5
        ("print('hello world')", "print('hello')", 0.6),  # a string literal is one token
        ("a a a + b", "a + b", 1.0),  # sets: repeats do not count
        ("goodbye world", "print('hello')", 0.0),
        (FENCED, "def add(a,b): return a+b", 1.0),  # only the fenced code is compared
        ("", "a + b", 0.0),
    ],
)
def test_scores(env, response, truth, score):
    assert code_jaccard(response, truth) == score
    ret = env.step([_log(response)], [{"ground_truth": truth}])
    assert torch.equal(ret.rewards, torch.tensor([score], dtype=torch.float32))


def test_code_tokens_and_extraction():
    assert code_tokens('f(x) -> "a b" != 1.5e-3') == [
        "f",
        "(",
        "x",
        ")",
        "->",
        '"a b"',
        "!=",
        "1.5e-3",
    ]
    assert extract_code(FENCED) == "def add(a, b):\n    return a + b\n"
    assert extract_code("```py\nx = 1") == "x = 1"  # an unclosed fence runs to the end
    assert (
        code_jaccard(FENCED.replace("```python", "").replace("```", ""), "def add(a,b): return a+b")
        == 10 / 15
    )


def test_observations_follow_the_threshold(env):
    logs = [_log("print('hello')"), _log("x = a + b"), _log("goodbye")]
    truths = [
        {"ground_truth": "print('hello')"},
        {"ground_truth": "return a + b"},
        {"ground_truth": "hi"},
    ]
    contents = [o["content"] for o in env.step(logs, truths).observations]
    assert contents == [
        "Environment: jaccard aligned (score: 1.00)",
        "Environment: jaccard misaligned (score: 0.50)",  # aligned means above the threshold
        "Environment: jaccard misaligned (score: 0.00)",
    ]
    lenient = CodeJaccardEnvironment({"alignment_threshold": 0.4})
    assert lenient.step(logs[1:2], truths[1:2]).observations[0]["content"] == (
        "Environment: jaccard aligned (score: 0.50)"
    )


def test_a_bad_ground_truth_fails_only_its_sample(env):
    logs = [_log("a + b"), _log("a + b"), _log("a + b"), _log("a + b")]
    metadata = [{"id": 7}, None, {"ground_truth": "  \n "}, {"ground_truth": "a + b", "id": 9}]
    ret = env.step(logs, metadata)
    assert ret.rewards.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert ret.terminateds.tolist() == [True] * 4
    assert ret.metadata == [
        {"id": 7, "jaccard_score": 0.0, "jaccard_error": NO_TRUTH},
        {"jaccard_score": 0.0, "jaccard_error": NO_TRUTH},
        {
            "ground_truth": "  \n ",
            "jaccard_score": 0.0,
            "jaccard_error": "ground_truth holds no code tokens",
        },
        {"ground_truth": "a + b", "id": 9, "jaccard_score": 1.0},
    ]
    assert (
        ret.observations[1]["content"]
        == f"Environment: jaccard misaligned (score: 0.00; {NO_TRUTH})"
    )


def test_answers_only_when_asked(env):
    logs = [_log("x = a + b"), _log(FENCED)]
    metadata = [{"ground_truth": "x = a + b"}, {"ground_truth": "return a + b"}]
    assert env.step(logs, metadata).answers is None
    answers = env.step(logs, metadata, return_extracted_answer=True).answers
    assert answers == ["x = a + b", "def add(a, b):\n    return a + b"]


def test_empty_batch(env):
    ret = env.step([], [], return_extracted_answer=True)
    assert (ret.observations, ret.metadata, ret.next_stop_strings, ret.answers) == ([], [], [], [])
    assert ret.rewards.shape == (0,) and ret.rewards.dtype == torch.float32
    assert ret.terminateds.shape == (0,) and ret.terminateds.dtype == torch.bool


def test_stop_strings_are_passed_on():
    ret = CodeJaccardEnvironment({"stop_strings": ["```\n"]}).step(
        [_log("a")], [{"ground_truth": "a"}]
    )
    assert ret.next_stop_strings == [["```\n"]]


def test_config_problems_are_reported_together():
    with pytest.raises(ConfigError) as raised:
        CodeJaccardEnvironment({"num_worker": 2, "alignment_threshold": 1.5, "stop_strings": [1]})  # type: ignore[typeddict-unknown-key]
    assert raised.value.problems == [
        "stop_strings[0]: expected str, got int (1)",
        "alignment_threshold: must be < 1, got 1.5",
        "num_worker: unknown option. Did you mean 'num_workers'?",
    ]
    with pytest.raises(ConfigError, match="num_workers: must be >= 1, got 0"):
        CodeJaccardEnvironment({"num_workers": 0})


def test_metrics(env):
    batch = BatchedDataDict(
        message_log=[_log("a")] * 4,
        extra_env_info=[{"jaccard_score": 1.0}, {}, {"jaccard_error": NO_TRUTH}, None],
        total_reward=torch.tensor([1.0, 0.5, 0.0, 0.75]),
    )
    returned, metrics = env.global_post_process_and_metrics(batch)
    assert returned is batch
    assert metrics == {
        "code_jaccard_env/mean_score": 2.25 / 4,
        "code_jaccard_env/aligned_fraction": 0.5,
        "code_jaccard_env/exact_fraction": 0.25,
        "code_jaccard_env/error_rate": 0.25,
        "code_jaccard_env/num_samples": 4,
    }


def test_contract_and_config_listing(env):
    ret = check_env(
        env, [_log("a + b"), _log("b")], [{"ground_truth": "a + b"}, {"ground_truth": "a + b"}]
    )
    assert torch.equal(ret.rewards, torch.tensor([1.0, 1 / 3]))
    fields = [(f.name, f.type, f.default) for f in env_config_fields(CodeJaccardEnvironment)]
    assert fields == [
        ("num_workers", "int", 1),
        ("stop_strings", "list of str or null", None),
        ("alignment_threshold", "float", 0.5),
    ]


@pytest.mark.ray
def test_as_a_ray_actor(ray_session):
    from envloop.environments.registry import create_env

    actor = create_env("code_jaccard", {"num_workers": 2}, num_cpus=0)
    ret = ray_session.get(
        actor.step.remote([_log(FENCED)], [{"ground_truth": "def add(a,b): return a+b"}])
    )
    assert ret.rewards.tolist() == [1.0]
    assert ret.observations[0]["content"] == "Environment: jaccard aligned (score: 1.00)"
    ray_session.kill(actor)
