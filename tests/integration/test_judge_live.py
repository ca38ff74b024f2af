"""The judge environment with the bundled judge, live: in process and in a Ray actor,
through both engines in sample and group mode, through a real llama-server, and a judge
server killed mid-run (its samples fail as data, none is lost)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import ray

from envloop.demo.tasks import MathItem
from envloop.environments.judge_environment import JudgeEnvironment
from envloop.environments.registry import create_env
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.bundled import resolve_model
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.llama_server import LlamaServer, converted_gguf

JUDGE = {"backend": "hf", "model_name": "bundled:judge", "max_new_tokens": 64}
GROUP_JUDGE = {**JUDGE, "max_new_tokens": 128}  # a line per reply
ITEMS = [MathItem(37, "+", 48), MathItem(52, "-", 38), MathItem(9, "+", 21)]
RIGHT = [item.response() for item in ITEMS]
WRONG = [item.response(answer=item.value + 1) for item in ITEMS]
TAIL = r"; reply (\d+|none):( \d\d[=!])* (yes|no)"
"""The end of a judge reply: the reply's number, both numbers' digits side by side (``=``
same, ``!`` different), the verdict."""


def conversation(item: MathItem, reply: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": item.question}, {"role": "assistant", "content": reply}]


@pytest.fixture(scope="module")
def judge_env():
    env = JudgeEnvironment({"judge": JUDGE})
    yield env
    env.shutdown()


def verdict_of(reply: str) -> float:
    """The score a yes/no judge reply is worth: its last word."""
    return {"yes": 1.0, "no": 0.0}[reply.rsplit(" ", 1)[-1]]


def test_bundled_judge_in_process_with_and_without_reference(judge_env):
    """The bundled judge answers in its trained format, reference copied or the question
    worked out first; each reward is its verdict (its accuracy: scripts/eval_judge.py)."""
    logs = [conversation(i, r) for i, r in zip(ITEMS * 2, RIGHT + WRONG)]
    with_ref = judge_env.step(logs, [{"ground_truth": i.ground_truth} for i in ITEMS * 2])
    replies = [m["judge"]["replies"][0] for m in with_ref.metadata]
    assert all(re.fullmatch(rf"reference \d+{TAIL}", r) for r in replies)
    assert with_ref.rewards.tolist() == [verdict_of(r) for r in replies]
    assert with_ref.observations[0]["content"] == (
        f"Environment: judge score {verdict_of(replies[0]):.4g}"
    )
    without = judge_env.step(logs, [{}] * 6)
    replies = [m["judge"]["replies"][0] for m in without.metadata]
    assert all(re.fullmatch(rf".*, so \d+{TAIL}", r) for r in replies)
    assert without.rewards.tolist() == [verdict_of(r) for r in replies]
    assert without.terminateds.tolist() == [True] * 6 and without.errors is None
    _, metrics = judge_env.global_post_process_and_metrics({})
    assert metrics["judge_env/judge_calls"] == metrics["judge_env/num_samples"] == 12
    assert metrics["judge_env/parse_failures"] == metrics["judge_env/failed_samples"] == 0
    assert metrics["judge_env/judge_generated_tokens"] > 12 * 10


def test_unusable_judgements_fail_their_sample_only():
    """A judge cut at its token budget, a verdict no parser reads, a response over the cap:
    errors (loss_multiplier 0 in a rollout) or score 0, the other samples judged."""
    log = conversation(ITEMS[0], RIGHT[0])
    short = JudgeEnvironment({"judge": {**JUDGE, "max_new_tokens": 3}})
    ret = short.step([log], [{"ground_truth": "85"}])
    assert ret.errors == ["judge: judge reply cut at its token budget (max_new_tokens)"]
    short.shutdown()
    labels = JudgeEnvironment(
        {"judge": JUDGE, "verdict": {"kind": "label", "labels": {"RIGHT": 1.0}},
         "on_failure": "zero", "max_parse_chars": 60}
    )  # fmt: skip
    ret = labels.step([log, conversation(ITEMS[0], "x" * 61)], [{"ground_truth": "85"}] * 2)
    assert ret.errors is None and ret.rewards.tolist() == [0.0, 0.0]
    assert (
        ret.metadata[0]["judge"]["error"] == "judge: none of the labels RIGHT in the judge's reply"
    )
    assert ret.metadata[1]["judge"]["error"] == (
        "judge: response has 61 characters, over max_parse_chars=60; raise max_parse_chars to "
        "score it"
    )
    assert labels.global_post_process_and_metrics({})[1]["judge_env/parse_failures"] == 1
    labels.shutdown()


def group_rollout(engine: Any, env: Any, tokenizer: Any) -> Any:
    """Two prompts x three generations: replies right, wrong, right (by call order)."""
    samples = [{"task": "judge", "prompt": i.question, "metadata": {"ground_truth": i.ground_truth}}
               for i in ITEMS[:2] for _ in range(3)]  # fmt: skip
    counts: dict[str, int] = {}

    def respond(text: str) -> str:
        item = next(i for i in ITEMS if i.question in text)
        counts[item.question] = counts.get(item.question, 0) + 1
        return item.response() if counts[item.question] != 2 else item.response(answer=1)

    policy = ScriptedGeneration(tokenizer, respond)
    final, _ = engine(policy, make_batch(tokenizer, samples), tokenizer, {"judge": env}, 256)
    return final


def test_group_mode_one_judge_call_per_prompt_in_both_engines(tiny_tokenizer):
    """Each prompt's three replies are judged in one call; both engines give the same
    rewards, each a rank within its group (share of the others beaten, ties half)."""
    finals = {}
    for name, run in [("sync", run_multi_turn_rollout), ("async", run_async_multi_turn_rollout)]:
        config = {"template": "group_comparison", "group_reward": "rank"}
        env = JudgeEnvironment({"judge": GROUP_JUDGE, "mode": "group", **config})
        finals[name] = group_rollout(run, env, tiny_tokenizer)
        _, metrics = env.global_post_process_and_metrics(finals[name])
        assert metrics["judge_env/judge_calls"] == 2 and metrics["judge_env/num_samples"] == 6
        env.shutdown()
    # Right, wrong, right per prompt: a right reply beats the wrong one and ties the other.
    for final in finals.values():
        assert final["env_error"] == [None] * 6
        assert final["total_reward"].tolist() == [0.75, 0.0, 0.75] * 2


@pytest.mark.ray
def test_group_mode_in_a_ray_actor_with_the_async_engine(ray_session, tiny_tokenizer):
    """Through a Ray actor (steps streamed with astep_stream, scores_groups asked
    remotely): the same rewards as in process, one judge call per prompt."""
    config = {"judge": GROUP_JUDGE, "mode": "group", "template": "group_comparison"}
    env = create_env("judge", config)
    final = group_rollout(lambda *a: asyncio.run(run_async_multi_turn_rollout(*a)), env,
                          tiny_tokenizer)  # fmt: skip
    _, metrics = ray.get(env.global_post_process_and_metrics.remote(final))
    assert metrics["judge_env/judge_calls"] == 2
    ray.kill(env)
    local = JudgeEnvironment(config)
    expected = group_rollout(run_multi_turn_rollout, local, tiny_tokenizer)
    assert final["total_reward"].tolist() == expected["total_reward"].tolist()
    assert final["env_error"] == [None] * 6
    local.shutdown()


@pytest.fixture(scope="module")
def judge_server():
    server = LlamaServer(converted_gguf(Path(resolve_model("bundled:judge")))).start()
    yield server
    server.stop()


def server_judge(server: LlamaServer) -> dict[str, Any]:
    return {"backend": "server", "base_urls": [server.url], "dialect": "llamacpp",
            "tokenizer": "bundled:judge", "max_new_tokens": 64, "max_retries": 1,
            "retry_backoff_s": 0.1, "request_timeout_s": 20.0}  # fmt: skip


@pytest.mark.server
def test_judge_through_llama_server_equals_in_process(judge_server, judge_env):
    logs = [conversation(i, r) for i, r in zip(ITEMS * 2, RIGHT + WRONG)]
    metadata = [{"ground_truth": i.ground_truth} for i in ITEMS * 2]
    env = JudgeEnvironment({"judge": server_judge(judge_server)})
    served, local = env.step(logs, metadata), judge_env.step(logs, metadata)
    assert served.rewards.tolist() == local.rewards.tolist()
    assert [m["judge"]["replies"] for m in served.metadata] == [
        m["judge"]["replies"] for m in local.metadata
    ]
    env.shutdown()


@pytest.mark.server
def test_judge_server_killed_mid_run_fails_samples_as_data(tiny_tokenizer):
    """The judge server is killed by pid once the first sample is judged: every sample still
    comes back, judged or failed with the reason (loss_multiplier 0), none is lost."""
    server = LlamaServer(converted_gguf(Path(resolve_model("bundled:judge"))), slots=1).start()
    env = JudgeEnvironment({"judge": server_judge(server)})
    samples = [{"task": "judge", "prompt": i.question, "metadata": {"ground_truth": i.ground_truth}}
               for i in ITEMS * 3]  # fmt: skip
    killed: list[int] = []

    def kill_after_first(progress: Any) -> None:
        if not killed and progress.samples_done >= 1:
            killed.append(server.process.pid)
            server.process.kill()

    policy = ScriptedGeneration(tiny_tokenizer, lambda text: "\\boxed{1}")
    final, _ = asyncio.run(run_async_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, {"judge": env}, 256,
        on_turn=kill_after_first, max_concurrent_samples=1,
    ))  # fmt: skip
    assert killed and len(final["total_reward"]) == 9
    errors = final["env_error"]
    assert errors[0] is None and final["loss_multiplier"][0] == 1.0
    failed = [i for i, e in enumerate(errors) if e is not None]
    assert failed and all("judge failed" in errors[i] for i in failed)
    assert all(final["loss_multiplier"][i] == 0.0 for i in failed)
    env.shutdown()
    server.stop()
