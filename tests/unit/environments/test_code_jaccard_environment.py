"""CodeJaccardEnvironment: NeMo-RL's word scores by default, envloop's code-token scores as
an option (fenced-code extraction), per-sample problems, config errors, metrics, the contract
checker and a Ray actor."""

from __future__ import annotations

import pytest
import torch

from envloop.config.env_fields import env_config_fields
from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.checker import check_env
from envloop.environments.code.similarity import (
    code_jaccard,
    code_tokens,
    extract_code,
    word_jaccard,
)
from envloop.environments.code_jaccard_environment import (
    CodeJaccardEnvConfig,
    CodeJaccardEnvironment,
)

FENCED = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
NO_TRUTH = "no ground_truth string in this sample's metadata"


def _log(response: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "Write it."}, {"role": "assistant", "content": response}]


CODE_TOKENS = CodeJaccardEnvConfig(similarity="code_tokens")


@pytest.fixture(scope="module")
def env():
    """envloop's code-token scoring (most tests below); ``words`` is tested at the end."""
    return CodeJaccardEnvironment(CodeJaccardEnvConfig(num_workers=2, similarity="code_tokens"))


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
    lenient = CodeJaccardEnvironment({**CODE_TOKENS, "alignment_threshold": 0.4})
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
        "code_jaccard_env/over_max_parse_chars": 0,
        "preference_alignment_rate": 0.5,
        "average_preference_score": 2.25 / 4,
        "high_alignment_rate": 0.25,
    }


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"
ADVERSARIAL = ["```python\n" * 120_000, "a = (" * 250_000, "'" * 1_000_001]


def test_megabyte_responses_over_the_default_cap_are_not_parsed(env):
    logs = [_log("x = a + b"), *[_log(r) for r in ADVERSARIAL]]
    ret = env.step(logs, [{"ground_truth": "a + b"}] * 4, return_extracted_answer=True)
    assert torch.equal(ret.rewards, torch.tensor([0.6, 0.0, 0.0, 0.0]))
    assert ret.answers == ["x = a + b", None, None, None]
    reasons = [
        f"response has 1,200,000 characters, {OVER_CAP}",
        f"response has 1,250,000 characters, {OVER_CAP}",
        f"response has 1,000,001 characters, {OVER_CAP}",
    ]
    assert ret.metadata[1:] == [
        {"ground_truth": "a + b", "jaccard_score": 0.0, "jaccard_error": why} for why in reasons
    ]
    assert ret.observations[1]["content"] == (
        f"Environment: jaccard misaligned (score: 0.00; {reasons[0]})"
    )
    assert ret.terminateds.tolist() == [True] * 4
    batch = BatchedDataDict(message_log=logs, extra_env_info=ret.metadata, total_reward=ret.rewards)
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics["code_jaccard_env/over_max_parse_chars"] == 3
    assert metrics["code_jaccard_env/error_rate"] == 0.75


def test_megabyte_responses_under_the_default_cap_get_their_exact_score(env):
    responses = ["x = a + b\n" * 99_000, "```python\n" * 99_000, "a = (" * 199_000]
    ret = env.step([_log(r) for r in responses], [{"ground_truth": "a + b"}] * 3)
    # {x, =, a, +, b} against {a, +, b}; an unclosed fence of fences holds no code; {a, =, (}.
    assert torch.equal(ret.rewards, torch.tensor([0.6, 0.0, 0.2]))
    assert [md.get("jaccard_error") for md in ret.metadata] == [None, None, None]


def test_the_cap_counts_the_response_and_the_ground_truth():
    env = CodeJaccardEnvironment({**CODE_TOKENS, "max_parse_chars": 12})
    at_cap, over = "a + b = c   ", "a + b = c    "  # 12 and 13 characters
    logs = [_log(at_cap), _log(over), _log("a + b")]
    metadata = [{"ground_truth": "a + b"}, {"ground_truth": "a + b"}, {"ground_truth": over}]
    ret = env.step(logs, metadata)
    assert torch.equal(ret.rewards, torch.tensor([0.6, 0.0, 0.0]))
    cap = "over max_parse_chars=12; raise max_parse_chars to score it"
    assert [md.get("jaccard_error") for md in ret.metadata] == [
        None,
        f"response has 13 characters, {cap}",
        f"ground_truth has 13 characters, {cap}",
    ]


@pytest.mark.parametrize(
    "poison",
    [{"ground_truth": 10**5000}, {"ground_truth": {"code": "a + b"}}, {"ground_truth": None}, [1]],
    ids=["huge_int", "nested", "none", "not_a_mapping"],
)
def test_one_poisoned_sample_scores_zero_and_the_others_are_scored(env, poison):
    healthy = {"ground_truth": "a + b"}
    logs = [_log("a + b"), _log("x = a + b"), _log("a + b"), _log("b")]
    ret = env.step(logs, [healthy, healthy, poison, healthy])
    assert torch.equal(ret.rewards, torch.tensor([1.0, 0.6, 0.0, 1 / 3]))
    assert ret.metadata[2]["jaccard_error"] == NO_TRUTH
    assert ret.errors is None


def test_a_sample_that_is_not_a_message_log_scores_zero_alone(env):
    ret = env.step([_log("a + b"), None, _log("b")], [{"ground_truth": "a + b"}] * 3)  # type: ignore[list-item]
    assert torch.equal(ret.rewards, torch.tensor([1.0, 0.0, 1 / 3]))
    assert ret.errors is None


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
        ("similarity", "one of words, code_tokens", "words"),
        ("max_parse_chars", "int", 1_000_000),
    ]


@pytest.mark.ray
def test_as_a_ray_actor(ray_session):
    from envloop.environments.registry import create_env

    actor = create_env("code_jaccard", {"num_workers": 2, **CODE_TOKENS}, num_cpus=0)
    ret = ray_session.get(
        actor.step.remote([_log(FENCED)], [{"ground_truth": "def add(a,b): return a+b"}])
    )
    assert ret.rewards.tolist() == [1.0]
    assert ret.observations[0]["content"] == "Environment: jaccard aligned (score: 1.00)"
    ray_session.kill(actor)


# --- similarity: words (NeMo-RL's score, the default) ----------------------------------------


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("  Return A + B\n", "return a + b", 1.0),  # stripped and lower-cased: equal
        ("import os\nprint(os.getcwd())", "def add(a, b):\n    return a + b", 0.0),
        ("return a", "return a + b", 0.5 * 8 / 12),  # 2 of 4 words; 8 of 12 characters
        ("a + b", "a  +  b", 5 / 7),  # the same words; lengths 5 and 7
        ("b + a", "a + b", 1.0),  # the same words and length, in another order
        ("", "a + b", 0.0),
        ("", "   ", 1.0),  # both empty once stripped: an exact match
        ("a", "  ", 0.0),  # a reference without words
        # prose and fences are words: 7 of 13; 31 of 64 characters
        (FENCED, "def add(a, b):\n    return a + b", 7 / 13 * 31 / 64),
    ],
)
def test_words_score_as_nemo_rl_does(response, truth, score):
    env = CodeJaccardEnvironment()
    assert word_jaccard(response, truth) == pytest.approx(score)
    ret = env.step([_log(response)], [{"ground_truth": truth}], return_extracted_answer=True)
    assert ret.rewards.tolist() == pytest.approx([score])
    assert ret.answers == [response.strip()]
    assert ret.metadata[0].get("jaccard_error") is None


def test_words_join_every_assistant_reply_and_keep_the_observation_texts():
    log = [
        {"role": "user", "content": "Write it."},
        {"role": "assistant", "content": "def add(a, b):"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": " return a + b"},
    ]
    ret = CodeJaccardEnvironment().step(
        [log, _log("return a")], [{"ground_truth": "def add(a, b): return a + b"}] * 2
    )
    assert ret.rewards.tolist() == pytest.approx([1.0, 2 / 7 * 8 / 27])
    assert [o["content"] for o in ret.observations] == [
        "Environment: jaccard aligned (score: 1.00)",
        "Environment: jaccard misaligned (score: 0.08)",
    ]
    missing = CodeJaccardEnvironment().step([_log("a")], [{"id": 3}])
    assert missing.metadata == [{"id": 3, "jaccard_score": 0.0, "jaccard_error": NO_TRUTH}]
