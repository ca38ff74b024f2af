"""The async engine: the same trajectories as the sync engine, samples that really run on
their own, and samples and GRPO groups streamed as they finish."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.environments import SampleEnvironment, SampleStep
from envloop.environments.games.sliding_puzzle import (
    SlidingPuzzleEnv,
    initial_prompt,
    new_episode_metadata,
)
from envloop.environments.math_environment import MathEnvironment
from envloop.experience import async_rollouts
from envloop.experience.rollouts import (
    EnvironmentStepError,
    RolloutStream,
    run_async_multi_turn_rollout,
    run_multi_turn_rollout,
)
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import calc_sample, guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import CalculatorEnv, EchoEnv, FailingEnv, GuessNumberEnv

SCRIPTED_MIX = [
    guess_sample(37),
    calc_sample("What is 12 * 7 + 1?", 85),
    {"task": "echo", "prompt": "Talk to me."},  # runs into max_seq_len: truncated
    guess_sample(50),
    {"task": "failing", "prompt": "Anything."},
    calc_sample("What is 9 - 2?", 7),
    guess_sample(99, max_guesses=4),
]


def scripted_envs():
    return {
        "calc": CalculatorEnv(),
        "guess": GuessNumberEnv(),
        "echo": EchoEnv(),
        "failing": FailingEnv(),
    }


def run_both(policy, batch, tokenizer, envs, max_seq_len, **kwargs):
    sync = run_multi_turn_rollout(policy, batch, tokenizer, envs, max_seq_len, **kwargs)
    async_ = asyncio.run(
        run_async_multi_turn_rollout(policy, batch, tokenizer, envs, max_seq_len, **kwargs)
    )
    return sync, async_


def assert_same_rollouts(sync, async_, logprob_atol=0.0):
    (s, s_metrics), (a, a_metrics) = sync, async_
    assert s.keys() == a.keys()
    for s_log, a_log in zip(s["message_log"], a["message_log"], strict=True):
        assert [(m["role"], m["content"]) for m in s_log] == [
            (m["role"], m["content"]) for m in a_log
        ]
        for s_msg, a_msg in zip(s_log, a_log):
            assert torch.equal(s_msg["token_ids"], a_msg["token_ids"])
            if "generation_logprobs" in s_msg:
                torch.testing.assert_close(
                    s_msg["generation_logprobs"], a_msg["generation_logprobs"],
                    atol=logprob_atol, rtol=0,
                )  # fmt: skip
    for key in ("total_reward", "truncated", "terminated", "num_turns", "loss_multiplier"):
        assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(a[key])), key
    for key in ("turn_rewards", "extra_env_info", "reward_components"):
        assert s[key] == a[key], key
    # An error's text ends with the environment's traceback; the engine's frames differ.
    assert [_first_and_last_line(e) for e in s["env_error"]] == [
        _first_and_last_line(e) for e in a["env_error"]
    ]
    timing = {k for k in s_metrics if k.startswith("timing/") or k.endswith("_s")}
    assert {k: v for k, v in s_metrics.items() if k not in timing} == {
        k: v for k, v in a_metrics.items() if k not in timing
    }


def _first_and_last_line(error):
    return None if error is None else (error.splitlines()[0], error.splitlines()[-1])


def test_async_equals_sync_with_a_scripted_policy(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, SCRIPTED_MIX)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    sync, async_ = run_both(policy, batch, tiny_tokenizer, scripted_envs(), 160)
    assert_same_rollouts(sync, async_)
    final = async_[0]
    assert final["num_turns"].tolist() == [3, 3, 3, 1, 1, 1, 4]
    assert final["truncated"].tolist() == [False, False, True, False, False, False, False]
    assert final["env_error"][4].startswith("env failing.step raised:")
    assert final["loss_multiplier"][4] == 0.0 and async_[1]["env_error_rate"] == pytest.approx(
        1 / 7
    )
    assert final["total_reward"].tolist() == [1.0, 1.0, 1.5, 1.0, 0.0, 0.0, 0.0]


def test_async_equals_sync_with_a_real_tiny_transformer(tiny_policy_dir):
    policy = HfGeneration({"model_name": str(tiny_policy_dir), "max_new_tokens": 6})
    tokenizer = policy.tokenizer
    puzzles = [new_episode_metadata(seed, size=2, max_moves=3) for seed in (1, 2)]
    samples = [
        calc_sample("What is 3 + 4?", 7),
        {"task": "math", "prompt": "What is 2 + 2?", "metadata": {"ground_truth": "4"}},
        {"task": "puzzle", "prompt": initial_prompt(puzzles[0]), "metadata": puzzles[0]},
        guess_sample(37, max_guesses=3),
        {"task": "echo", "prompt": "Talk to me.", "metadata": {"reply": "The quick fox " * 60}},
        {"task": "failing", "prompt": "Anything."},
        {"task": "puzzle", "prompt": initial_prompt(puzzles[1]), "metadata": puzzles[1]},
        {"task": "math", "prompt": "What is 5 + 5?", "metadata": {"ground_truth": "10"}},
    ]
    envs = {
        **scripted_envs(),
        "math": MathEnvironment({"num_workers": 1}),
        "puzzle": SlidingPuzzleEnv(),
    }
    batch = make_batch(tokenizer, samples)
    try:
        sync, async_ = run_both(
            policy, batch, tokenizer, envs, 400, max_rollout_turns=3, greedy=True,
            observation_format="chat_template",
        )  # fmt: skip
    finally:
        envs["math"].shutdown()
    # Batch composition changes float rounding, never the greedy tokens here.
    assert_same_rollouts(sync, async_, logprob_atol=1e-4)
    final = async_[0]
    assert final["truncated"][4] and final["env_error"][5] is not None
    assert final["num_turns"].max() == 3


class StreamingScripted(ScriptedGeneration):
    """``ScriptedGeneration`` handing rows back one at a time, last row first, as
    continuous batching does: each after a turn of the event loop, or (``burst``) all in
    one turn."""

    def __init__(self, *args, burst=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.burst = burst

    async def generate_async(self, data, greedy=False):
        output = self.generate(data, greedy)
        for j in reversed(range(output.size)):
            if not self.burst:
                await asyncio.sleep(0)
            yield j, output.slice(j, j + 1)


def test_async_equals_sync_with_a_policy_handing_rows_back_one_at_a_time(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, SCRIPTED_MIX)
    policy = StreamingScripted(tiny_tokenizer, scripted_respond)
    assert_same_rollouts(*run_both(policy, batch, tiny_tokenizer, scripted_envs(), 160))


@pytest.mark.parametrize("burst", [True, False])
def test_rows_handed_back_one_after_another_are_appended_in_one_step(
    tiny_tokenizer, monkeypatch, burst
):
    """All in one turn of the event loop, or one per turn: the rows are appended once no
    turn brings another."""
    appended = []
    append = async_rollouts.append_response_rows

    def recording(state, samples, *args):
        appended.append(list(samples))
        return append(state, samples, *args)

    monkeypatch.setattr(async_rollouts, "append_response_rows", recording)
    batch = make_batch(tiny_tokenizer, [guess_sample(25)] * 4)  # two guesses each: 50, 25
    policy = StreamingScripted(tiny_tokenizer, scripted_respond, burst=burst)
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512
        )
    )
    assert final["num_turns"].tolist() == [2, 2, 2, 2]
    assert [sorted(samples) for samples in appended] == [[0, 1, 2, 3], [0, 1, 2, 3]]


class WaitForOther(EchoEnv):
    """Blocks its step until ``release`` is set (by the other task's environment)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def step(self, message_log_batch, metadata, *args, **kwargs):
        if not self.release.wait(timeout=60):
            raise TimeoutError("the other sample never finished three turns: a barrier")
        ret = super().step(message_log_batch, metadata)
        return ret._replace(terminateds=torch.ones(len(metadata), dtype=torch.bool))


class ReleaseAfterThree(GuessNumberEnv):
    """A guessing game that sets ``release`` once a sample has finished its third turn."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def step(self, message_log_batch, metadata, *args, **kwargs):
        ret = super().step(message_log_batch, metadata)
        if any(md["guesses"] >= 3 for md in ret.metadata):
            self.release.set()
        return ret


def test_a_sample_waiting_on_another_does_not_stop_it(tiny_tokenizer):
    """Sample 0's first step returns only after sample 1 has taken three turns: a rollout
    with a barrier between turns would never finish."""
    release = threading.Event()
    envs = {"wait": WaitForOther(release), "guess": ReleaseAfterThree(release)}
    samples = [{"task": "wait", "prompt": "Hold on."}, guess_sample(99, max_guesses=5)]
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, envs, 512
        )
    )
    assert final["env_error"] == [None, None]
    assert final["num_turns"].tolist() == [1, 5]


class WaiterAndRunner(SampleEnvironment):
    """The ``waiter`` sample's step returns only once the ``runner`` sample has finished
    three turns; both are this one task's samples, so they share its first call."""

    max_concurrent_samples = 2

    def __init__(self) -> None:
        self.release = threading.Event()

    def step_sample(self, messages, metadata):
        if metadata["role"] == "waiter":
            if not self.release.wait(timeout=60):
                raise TimeoutError("the runner never finished three turns: a barrier")
            return SampleStep("released", reward=1.0, terminated=True)
        turns = metadata["turns"] + 1
        if turns == 3:
            self.release.set()
        return SampleStep(
            f"turn {turns}",
            reward=0.0,
            terminated=turns == 4,
            metadata={**metadata, "turns": turns},
        )


def test_samples_sharing_an_environment_call_go_on_as_each_finishes(tiny_tokenizer):
    """A per-sample environment hands back each sample of a call as it finishes: the runner
    takes three more turns while the waiter, from the same call, is still stepping."""
    samples = [
        {"task": "pair", "prompt": "Wait.", "metadata": {"role": "waiter"}},
        {"task": "pair", "prompt": "Run.", "metadata": {"role": "runner", "turns": 0}},
    ]
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer,
            {"pair": WaiterAndRunner()}, 512,
        )
    )  # fmt: skip
    assert final["env_error"] == [None, None]
    assert final["num_turns"].tolist() == [1, 4]
    assert final["total_reward"].tolist() == [1.0, 0.0]


class AllTogether(EchoEnv):
    """Each step waits until ``barrier.parties`` steps are waiting at once, then ends its
    samples: it completes only if that many environment calls can be in flight together."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.barrier.wait(timeout=60)
        ret = super().step(message_log_batch, metadata)
        return ret._replace(terminateds=torch.ones(len(metadata), dtype=torch.bool))


def test_many_blocked_environment_calls_wait_together(tiny_tokenizer):
    """Twenty environment calls (one sample each) block at once; a pool of a few threads
    (asyncio's default has min(32, cores + 4)) would hold the others back forever."""
    barrier = threading.Barrier(20)
    samples = [{"task": "together", "prompt": f"Sample {i}."} for i in range(20)]
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer,
            {"together": AllTogether(barrier)}, 512, max_coalesced_samples=1,
        )
    )  # fmt: skip
    assert final["env_error"] == [None] * 20
    assert final["num_turns"].tolist() == [1] * 20


def test_samples_and_groups_stream_in_completion_order(tiny_tokenizer):
    # Groups of two: group 1 needs one guess, group 2 two, group 0 six (binary search).
    samples = [guess_sample(99), guess_sample(99), guess_sample(50), guess_sample(50),
               guess_sample(25), guess_sample(25)]  # fmt: skip
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    batch = make_batch(tiny_tokenizer, samples)

    async def collect(stream, groups):
        items = stream.groups(2) if groups else stream
        return [item async for item in items]

    stream = RolloutStream(policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512)
    groups = asyncio.run(collect(stream, groups=True))
    assert [g.indices for g in groups] == [[2, 3], [4, 5], [0, 1]]
    final = stream.final_batch()
    assert final["num_turns"].tolist() == [6, 6, 1, 1, 2, 2]
    for group in groups:
        assert group.batch["num_turns"].tolist() == [final["num_turns"][i] for i in group.indices]
        assert group.batch["message_log"] == [final["message_log"][i] for i in group.indices]
        assert group.batch["idx"] == group.indices

    stream = RolloutStream(policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512)
    finished = asyncio.run(collect(stream, groups=False))
    assert sorted(s.index for s in finished) == list(range(6))
    assert [s.index for s in finished][-2:] in ([0, 1], [1, 0])  # the longest finish last
    for sample in finished:
        assert sample.batch.size == 1
        assert sample.batch["total_reward"].tolist() == [1.0]
        assert sample.batch["extra_env_info"] == [final["extra_env_info"][sample.index]]
    with pytest.raises(RuntimeError, match="runs once"):
        asyncio.run(collect(stream, groups=False))


def test_a_stream_that_stops_admitting_finishes_the_started_samples_only(tiny_tokenizer):
    # One sample at a time: 0 needs one guess, 1 six; 0's end starts 1, then the stop.
    samples = [guess_sample(50), guess_sample(99)] + [guess_sample(50)] * 4
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    batch = make_batch(tiny_tokenizer, samples)
    whole = RolloutStream(policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512)
    asyncio.run(collect_samples(whole))

    async def stop_after_first(stream):
        yielded = []
        async for sample in stream:
            yielded.append(sample)
            stream.stop_admitting()
        return yielded

    stream = RolloutStream(
        policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, max_concurrent_samples=1
    )
    yielded = asyncio.run(stop_after_first(stream))
    assert [s.index for s in yielded] == [0, 1]  # 1 was in flight: it finished
    for sample in yielded:  # as in the whole run
        [log] = sample.batch["message_log"]
        assert [m["content"] for m in log] == [
            m["content"] for m in whole.final_batch()["message_log"][sample.index]
        ]
        assert sample.batch["total_reward"].tolist() == [1.0]
    assert stream.state.turns.tolist() == [1, 6, 0, 0, 0, 0]  # 2-5 never started
    with pytest.raises(RuntimeError, match="stopped admitting samples"):
        stream.metrics()

    stopped_first = RolloutStream(policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512)
    stopped_first.stop_admitting()
    assert asyncio.run(collect_samples(stopped_first)) == []


async def collect_samples(stream):
    return [sample async for sample in stream]


def test_bounded_concurrency_gives_the_same_rollouts(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, SCRIPTED_MIX)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    envs = scripted_envs()
    unbounded = asyncio.run(run_async_multi_turn_rollout(policy, batch, tiny_tokenizer, envs, 160))
    one_at_a_time = asyncio.run(
        run_async_multi_turn_rollout(
            policy, batch, tiny_tokenizer, envs, 160, max_concurrent_samples=1,
            coalesce_window_s=0, max_coalesced_samples=1,
        )
    )  # fmt: skip
    assert_same_rollouts(unbounded, one_at_a_time)


def test_a_failing_environment_raises_with_on_env_error_raise(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, SCRIPTED_MIX)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    with pytest.raises(EnvironmentStepError, match="boom: the failing environment"):
        asyncio.run(
            run_async_multi_turn_rollout(
                policy, batch, tiny_tokenizer, scripted_envs(), 160, on_env_error="raise"
            )
        )


def test_options_are_validated_together(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, SCRIPTED_MIX)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    with pytest.raises(ConfigError) as info:
        RolloutStream(
            policy, batch, tiny_tokenizer, scripted_envs(), 160, max_concurrent_samples=0,
            coalesce_window_s=-1, max_coalesced_sample=4,
        )  # fmt: skip
    assert info.value.problems == [
        "max_concurrent_samples: must be >= 1, got 0",
        "coalesce_window_s: must be >= 0, got -1",
        "max_coalesced_sample: unknown option. Did you mean 'max_coalesced_samples'?",
    ]
    with pytest.raises(ConfigError, match="max_concurrent_samples: unknown option"):
        run_multi_turn_rollout(
            policy, batch, tiny_tokenizer, scripted_envs(), 160, max_concurrent_samples=2
        )
    with pytest.raises(ValueError, match="group_size must be a positive int dividing"):
        stream = RolloutStream(policy, batch, tiny_tokenizer, scripted_envs(), 160)
        asyncio.run(stream.groups(2).__anext__())


class CallSizes(GuessNumberEnv):
    """Records how many samples each step call gets."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def step(self, message_log_batch, metadata, *args, **kwargs):
        with self.lock:
            self.sizes.append(len(metadata))
        return super().step(message_log_batch, metadata)


def test_waiting_samples_are_shared_evenly_among_the_fewest_calls(tiny_tokenizer):
    # Seven samples reach the environment together, at most three a call: 3, 2, 2, not a
    # call of one left over.
    env = CallSizes()
    samples = [guess_sample(50, max_guesses=1) for _ in range(7)]
    final, _ = asyncio.run(
        run_async_multi_turn_rollout(
            ScriptedGeneration(tiny_tokenizer, scripted_respond),
            make_batch(tiny_tokenizer, samples), tiny_tokenizer, {"guess": env}, 512,
            max_coalesced_samples=3,
        )
    )  # fmt: skip
    assert final["total_reward"].tolist() == [1.0] * 7
    assert sorted(env.sizes, reverse=True) == [3, 2, 2]
