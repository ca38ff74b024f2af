"""How judgements become a sample's outcome: usable judgements scored and aggregated, unusable
ones (failed, cut at the budget, unreadable) failing the sample only when none is usable,
the EnvironmentReturn of judged samples under both failure policies, and group rewards."""

from __future__ import annotations

import torch

from envloop.environments.judge.calls import JudgeCounts, Reply
from envloop.environments.judge.config import validate_config
from envloop.environments.judge.metrics import JudgeMetrics
from envloop.environments.judge.outcomes import Judged, agreement, judged_return, score_replies
from envloop.environments.judge_environment import _set_group_rewards

YES_NO = validate_config()["verdict"]


def test_usable_judgements_are_aggregated():
    replies = [
        Reply("…: yes"),
        Reply("…: no"),
        Reply("…: yes"),
        Reply("huh"),
        Reply(truncated=True),
    ]
    judged = score_replies(replies, YES_NO, "mean", 100)
    assert judged.score == 2 / 3 and judged.error is None
    assert judged.scores == [1.0, 0.0, 1.0, None, None]
    assert judged.parse_failures == 1  # the truncated one is not a parse failure
    assert score_replies(replies, YES_NO, "majority", 100).score == 1.0
    assert agreement(judged.scores) == 1 / 3


def test_no_usable_judgement_fails_with_every_reason_once():
    replies = [Reply(error="judge failed: ServerDown"), Reply("maybe"), Reply("maybe")]
    judged = score_replies(replies, YES_NO, "mean", 100)
    assert judged.score is None
    assert judged.error == "judge: judge failed: ServerDown; no yes or no in the judge's reply"


def test_return_under_both_failure_policies():
    config = validate_config({"max_attempts": 2, "pass_score": 0.5})
    judged = [Judged(1.0), Judged(0.25), Judged(None, "judge: no yes or no in the judge's reply")]
    metadata = [{"ground_truth": "1"}, None, {"ground_truth": "3"}]
    ret = judged_return(judged, metadata, [1, 1, 1], config)
    assert ret.rewards.tolist() == [1.0, 0.25, 0.0]
    assert ret.terminateds.tolist() == [True, False, True]  # 0.25 < pass_score: answer again
    assert ret.errors == [None, None, "judge: no yes or no in the judge's reply"]
    assert ret.metadata[2] == {"ground_truth": "3"}  # a failed sample's metadata is unchanged
    assert ret.metadata[1]["judge"]["score"] == 0.25
    assert ret.observations[1] == {
        "role": "environment",
        "content": "Environment: judge score 0.25",
    }
    zero = judged_return(judged, metadata, [1, 2, 1], {**config, "on_failure": "zero"})
    assert zero.errors is None and zero.terminateds.tolist() == [True, True, True]
    assert zero.metadata[2]["judge"]["error"] == "judge: no yes or no in the judge's reply"
    assert zero.observations[2]["content"] == (
        "Environment: judge score 0 (not judged: judge: no yes or no in the judge's reply)"
    )
    assert zero.rewards.dtype == torch.float32


def test_group_rewards():
    members = [Judged(1.0), Judged(0.0), Judged(1.0), Judged(None, "x")]
    _set_group_rewards(members, "rank")
    assert [m.reward for m in members] == [0.75, 0.0, 0.75, None]
    _set_group_rewards(members, "score")
    assert [m.reward for m in members] == [1.0, 0.0, 1.0, None]
    alone = [Judged(0.4)]
    _set_group_rewards(alone, "rank")
    assert alone[0].reward == 0.4


def test_metrics():
    metrics = JudgeMetrics()
    metrics.count(Judged(1.0, scores=[1.0, 1.0]))
    metrics.count(Judged(None, "x", parse_failures=2, scores=[None, None]))
    counts = JudgeCounts(calls=2, judgements=4, prompt_tokens=400, generated_tokens=40,
                         latencies_s=[0.5, 1.5], truncated=1)  # fmt: skip
    out = metrics.take(counts)
    assert out == {
        "judge_env/num_samples": 2, "judge_env/failed_samples": 1, "judge_env/mean_score": 1.0,
        "judge_env/agreement": 1.0, "judge_env/parse_failures": 2, "judge_env/judge_calls": 2,
        "judge_env/judgements": 4, "judge_env/failed_judgements": 0,
        "judge_env/truncated_judgements": 1, "judge_env/judge_prompt_tokens": 400,
        "judge_env/judge_generated_tokens": 40, "judge_env/mean_latency_s": 1.0,
        "judge_env/max_latency_s": 1.5,
    }  # fmt: skip
    assert metrics.take(JudgeCounts())["judge_env/num_samples"] == 0
