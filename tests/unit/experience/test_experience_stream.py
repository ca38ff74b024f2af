"""ExperienceStream: every prompt one complete group, bounded staleness with regeneration,
backpressure, close(), failures as data, and per-token policy versions in the engines."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from envloop.experience.rollouts import (
    ExperienceStream,
    RolloutStream,
    run_multi_turn_rollout,
)
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import ComponentRewardEnv, DieOnceEnv, FailingEnv, GuessNumberEnv

SECRETS = [99, 50, 25, 37, 12, 80, 64, 3]


def guess_rows(tokenizer, secrets=SECRETS):
    """One DatumSpec dict per secret (guessing games: 1 to 7 turns by binary search)."""
    batch = make_batch(tokenizer, [guess_sample(s) for s in secrets])
    return [{key: batch[key][i] for key in batch} for i in range(batch.size)]


async def collect(stream, on_group=None):
    groups = []
    async for group in stream:
        groups.append(group)
        if on_group is not None:
            await on_group(group)
    return groups


def test_every_prompt_of_a_finite_source_yields_one_complete_group(tiny_tokenizer):
    rows = guess_rows(tiny_tokenizer)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(
        policy, rows, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_concurrent_samples=6,
    )  # fmt: skip
    groups = asyncio.run(collect(stream))
    assert sorted(g.indices for g in groups) == [[2 * k, 2 * k + 1] for k in range(len(rows))]
    # The same trajectories as the batched engine on the same prompts, repeated twice.
    batch = make_batch(tiny_tokenizer, [guess_sample(s) for s in SECRETS]).repeat_interleave(2)
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512
    )
    for group in groups:
        assert group.batch.size == 2
        assert group.batch["num_turns"].tolist() == [final["num_turns"][i] for i in group.indices]
        assert group.batch["total_reward"].tolist() == [1.0, 1.0]
        for got, i in zip(group.batch["message_log"], group.indices):
            assert [m["content"] for m in got] == [m["content"] for m in final["message_log"][i]]
            assert torch.equal(
                torch.cat([m["token_ids"] for m in got]),
                torch.cat([m["token_ids"] for m in final["message_log"][i]]),
            )
        assert (group.min_policy_version, group.max_policy_version) == (0, 0)
    metrics = stream.metrics()
    assert metrics["groups_yielded"] == len(rows)
    assert metrics["samples_yielded"] == 2 * len(rows)
    assert metrics["groups_dropped_stale"] == 0
    assert metrics["total_turns"] == int(final["num_turns"].sum())
    assert (metrics["total_env_step_retries"], metrics["total_generation_retries"]) == (0, 0)


@pytest.mark.parametrize("source", ["batch", "async"])
def test_a_batch_or_an_async_iterable_is_read_row_by_row(tiny_tokenizer, source):
    rows = guess_rows(tiny_tokenizer, SECRETS[:3])
    batch = make_batch(tiny_tokenizer, [guess_sample(s) for s in SECRETS[:3]])

    async def prompts():
        for row in rows:
            await asyncio.sleep(0)
            yield row

    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(
        policy, batch if source == "batch" else prompts(), tiny_tokenizer,
        {"guess": GuessNumberEnv()}, 512,
    )  # fmt: skip
    groups = asyncio.run(collect(stream))
    assert sorted(g.indices for g in groups) == [[0], [1], [2]]
    by_index = {g.indices[0]: g.batch for g in groups}
    assert [by_index[k]["idx"] for k in range(3)] == [[0], [1], [2]]
    assert [by_index[k]["num_turns"].tolist() for k in range(3)] == [[6], [1], [2]]


def versioned_respond(version):
    """The scripted guesser, with the version it plays as in every response."""

    def respond(prompt_text):
        return f"v{version} " + scripted_respond(prompt_text)

    return respond


def test_strictly_on_policy_groups_never_span_versions_and_stale_ones_run_again(tiny_tokenizer):
    rows = guess_rows(tiny_tokenizer)
    policy = ScriptedGeneration(tiny_tokenizer, versioned_respond(0))
    stream = ExperienceStream(
        policy, rows, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_staleness=0, max_concurrent_samples=8,
    )  # fmt: skip

    async def train_then_update(group):
        assert group.min_policy_version == group.max_policy_version == policy.policy_version
        policy.update_weights(versioned_respond(policy.policy_version + 1))

    groups = asyncio.run(collect(stream, train_then_update))
    assert sorted(g.indices for g in groups) == [[2 * k, 2 * k + 1] for k in range(len(rows))]
    for group in groups:
        version = group.min_policy_version
        for log in group.batch["message_log"]:
            for message in log:
                if message["role"] == "assistant":
                    assert message["content"].startswith(f"v{version} ")
                    assert message["generation_policy_versions"].tolist() == [version] * len(
                        message["token_ids"]
                    )
        assert group.batch["min_policy_version"].tolist() == [version, version]
        assert group.batch["max_policy_version"].tolist() == [version, version]
    metrics = stream.metrics()
    assert metrics["groups_dropped_stale"] > 0
    assert metrics["regenerations"] == metrics["groups_dropped_stale"]
    assert metrics["max_staleness"] == 0 and metrics["max_version_span"] == 0
    assert metrics["groups_yielded"] == len(rows)


def test_without_a_bound_groups_keep_the_versions_they_were_generated_with(tiny_tokenizer):
    rows = guess_rows(tiny_tokenizer)
    policy = ScriptedGeneration(tiny_tokenizer, versioned_respond(0))
    stream = ExperienceStream(
        policy, rows, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_concurrent_samples=16,
    )  # fmt: skip

    async def update(group):
        policy.update_weights(versioned_respond(policy.policy_version + 1))
        await asyncio.sleep(0.01)  # let the other samples take turns under the new version

    groups = asyncio.run(collect(stream, update))
    assert len(groups) == len(rows) and stream.metrics()["groups_dropped_stale"] == 0
    spans = []
    for group in groups:
        turn_versions = [
            [int(m["generation_policy_versions"][0]) for m in log if m["role"] == "assistant"]
            for log in group.batch["message_log"]
        ]
        for versions, log in zip(turn_versions, group.batch["message_log"]):
            contents = [m["content"] for m in log if m["role"] == "assistant"]
            assert [c.split()[0] for c in contents] == [f"v{v}" for v in versions]
        flat = [v for versions in turn_versions for v in versions]
        assert (group.min_policy_version, group.max_policy_version) == (min(flat), max(flat))
        spans.append(max(flat) - min(flat))
    assert max(spans) > 0  # the long games played on across updates
    assert stream.metrics()["max_version_span"] == max(spans)


def counted_prompts(tokenizer, taken: list[int]):
    """Four rounds of the guessing prompts, each one's position appended to ``taken`` as
    the stream reads it."""
    for k, row in enumerate(guess_rows(tokenizer) * 4):
        taken.append(k)
        yield row


def test_backpressure_holds_admission_while_the_consumer_sleeps(tiny_tokenizer):
    taken: list[int] = []
    prompts = counted_prompts(tiny_tokenizer, taken)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(
        policy, prompts, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_concurrent_samples=4, max_buffered_groups=1,
    )  # fmt: skip
    seen = []

    async def sleepy_consumer(group):
        before = len(taken)
        await asyncio.sleep(0.2)  # generation is instant: it could run far ahead
        seen.append((before, len(taken)))
        # Taken at most: the groups consumed, one buffered, and two running.
        assert len(taken) <= len(seen) + 1 + 2

    groups = asyncio.run(collect(stream, sleepy_consumer))
    assert len(groups) == 4 * len(SECRETS)
    assert stream.metrics()["generation_wait_s"] > 0


def test_stop_admitting_yields_the_started_groups_then_ends(tiny_tokenizer):
    taken: list[int] = []
    prompts = counted_prompts(tiny_tokenizer, taken)
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(
        policy, prompts, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_concurrent_samples=6,
    )  # fmt: skip

    seen: list = []
    started: list[int] = []

    async def run():
        async for group in stream:
            seen.append(group)
            if len(seen) == 1:  # the prompts started by now are those taken from the source
                started.extend(taken)
                stream.stop_admitting()

    asyncio.run(run())
    # Every prompt taken before the stop, and only those, yields its whole group.
    assert started and len(started) < 4 * len(SECRETS)
    assert sorted(g.indices[0] // 2 for g in seen) == started
    assert all(g.batch.size == 2 for g in seen)
    assert stream.metrics()["groups_yielded"] == len(started)


def test_a_failing_environment_leaves_its_sample_in_the_group(tiny_tokenizer):
    batch = make_batch(
        tiny_tokenizer, [guess_sample(50), {"task": "failing", "prompt": "Anything."}]
    )
    rows = [{key: batch[key][i] for key in batch} for i in range(2)]
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    envs = {"guess": GuessNumberEnv(), "failing": FailingEnv()}
    stream = ExperienceStream(policy, rows, tiny_tokenizer, envs, 512, group_size=3)
    groups = {g.indices[0]: g for g in asyncio.run(collect(stream))}
    failed = groups[3].batch
    assert failed.size == 3 and failed["loss_multiplier"] == [0.0, 0.0, 0.0]
    assert all(e.startswith("env failing.step raised:") for e in failed["env_error"])
    assert groups[0].batch["loss_multiplier"] == [1.0, 1.0, 1.0]
    assert stream.metrics()["env_or_generation_error_rate"] == 0.5


@pytest.mark.ray
def test_an_environment_actor_that_dies_is_retried_and_counted(
    ray_session, tiny_tokenizer, tmp_path
):
    batch = make_batch(tiny_tokenizer, [{"task": "echo", "prompt": f"p{i}"} for i in range(3)])
    rows = [{key: batch[key][i] for key in batch} for i in range(3)]
    env = DieOnceEnv.options(num_cpus=0, max_restarts=1, max_task_retries=0).remote(
        str(tmp_path / "died")
    )
    try:
        policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "hi")
        stream = ExperienceStream(policy, rows, tiny_tokenizer, {"echo": env}, 512, group_size=2)
        groups = asyncio.run(collect(stream))
    finally:
        ray_session.kill(env)
    assert sorted(g.indices for g in groups) == [[0, 1], [2, 3], [4, 5]]
    assert all(g.batch["env_error"] == [None, None] for g in groups)
    assert stream.metrics()["total_env_step_retries"] >= 1


def test_close_mid_stream_leaves_nothing_running(tiny_policy_dir):
    policy = HfGeneration({"model_name": str(tiny_policy_dir), "max_new_tokens": 40})
    tokenizer = policy.tokenizer
    rows = guess_rows(tokenizer) * 8

    before = set(threading.enumerate())

    async def first_group_then_close():
        stream = ExperienceStream(
            policy, rows, tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
            max_concurrent_samples=8,
        )  # fmt: skip
        first = await anext(stream)
        await stream.close()
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return first, leftover

    async def leave_the_block_early():
        async with ExperienceStream(
            policy, rows, tokenizer, {"guess": GuessNumberEnv()}, 512, max_concurrent_samples=4
        ) as stream:
            async for _ in stream:
                break
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    first, leftover = asyncio.run(first_group_then_close())
    assert first.batch.size == 2 and leftover == []
    assert asyncio.run(leave_the_block_early()) == []
    started = set(threading.enumerate()) - before
    assert not [t for t in started if t.name.startswith("envloop-env")]
    for thread in [t for t in started if t.name == "envloop-decode"]:
        thread.join(timeout=60)  # drops the abandoned rows at its next step, then ends
        assert not thread.is_alive()
    assert policy.decode_stats()[0]["requests"] > 2  # other groups were mid-generation


def test_filter_groups_drops_groups_without_reward_signal_and_admits_more_prompts(
    tiny_tokenizer,
):
    # One guess each: member 0 of every group guesses 50, member 1 guesses 1 (one group per
    # generate call, its rows in member order). Secret 50: rewards [1, 0], a signal;
    # other secrets: [0, 0], none.
    secrets = [50, 37, 50, 12, 80]
    batch = make_batch(tiny_tokenizer, [guess_sample(s, max_guesses=1) for s in secrets])
    rows = [{key: batch[key][i] for key in batch} for i in range(batch.size)]
    calls = iter(range(1000))
    policy = ScriptedGeneration(
        tiny_tokenizer,
        lambda _: "<guess>50</guess>" if next(calls) % 2 == 0 else "<guess>1</guess>",
    )
    stream = ExperienceStream(
        policy, rows, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512, group_size=2,
        max_concurrent_samples=2, filter_groups=True,
    )  # fmt: skip
    groups = asyncio.run(collect(stream))
    assert [g.indices for g in groups] == [[0, 1], [4, 5]]  # prompts 0 and 2
    assert [g.batch["total_reward"].tolist() for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    metrics = stream.metrics()
    assert (metrics["groups_yielded"], metrics["groups_dropped_uninformative"]) == (2, 3)
    assert metrics["groups_dropped_stale"] == 0


def test_a_group_carries_the_reward_components_its_own_members_reported(tiny_tokenizer):
    # One prompt at a time, alternating a task with reward components and one without:
    # the slot is reused, and a guessing game's group never inherits the other's columns.
    parts = {"task": "parts", "prompt": "Say something."}
    samples = [parts, guess_sample(50), parts, guess_sample(50)]
    batch = make_batch(tiny_tokenizer, samples)
    rows = [{key: batch[key][i] for key in batch} for i in range(batch.size)]
    envs = {"parts": ComponentRewardEnv(), "guess": GuessNumberEnv()}
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(policy, rows, tiny_tokenizer, envs, 512, max_concurrent_samples=1)
    groups = asyncio.run(collect(stream))
    assert [g.indices for g in groups] == [[0], [1], [2], [3]]
    components = {"reward/format", "reward/length"}
    for group in groups:
        own = components if group.batch["task_name"] == ["parts"] else set()
        assert components & set(group.batch) == own
        assert group.batch["reward_components"] == [sorted(own)]
    assert groups[0].batch["reward/format"].tolist() == [0.25]


def test_arguments_are_checked_together(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    with pytest.raises(ValueError) as info:
        ExperienceStream(
            policy, [], tiny_tokenizer, {}, 512, group_size=0, max_staleness=-1,
            max_buffered_groups=True, filter_groups=True,
        )  # fmt: skip
    assert str(info.value) == (
        "Invalid ExperienceStream arguments: group_size must be an int >= 1, got 0; "
        "max_staleness must be None or an int >= 0, got -1; "
        "max_buffered_groups must be None or an int >= 1, got True; "
        "filter_groups=True needs group_size >= 2 (got 0): a group of one has no reward "
        "signal to keep"
    )


def test_a_bad_prompt_names_its_position_in_the_source(tiny_tokenizer):
    rows = guess_rows(tiny_tokenizer, SECRETS[:2])
    bad = dict(rows[1], task_name="gues")
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    stream = ExperienceStream(
        policy, [rows[0], bad], tiny_tokenizer, {"guess": GuessNumberEnv()}, 512
    )
    with pytest.raises(ValueError, match="gues.*Did you mean 'guess'"):
        asyncio.run(collect(stream))


def test_generation_policy_versions_reach_the_final_batch(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    policy.update_weights(scripted_respond, version=3)
    batch = make_batch(tiny_tokenizer, [guess_sample(50), guess_sample(25)])
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512
    )
    assert final["min_policy_version"].tolist() == [3, 3]
    assert final["max_policy_version"].tolist() == [3, 3]
    for log in final["message_log"]:
        for message in log:
            if message["role"] == "assistant":
                versions = message["generation_policy_versions"]
                assert versions.dtype == torch.int32
                assert versions.tolist() == [3] * len(message["token_ids"])


def test_rollout_stream_groups_carry_their_version_span(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    batch = make_batch(tiny_tokenizer, [guess_sample(50)] * 2)

    async def groups():
        stream = RolloutStream(policy, batch, tiny_tokenizer, {"guess": GuessNumberEnv()}, 512)
        return [g async for g in stream.groups(2)]

    (group,) = asyncio.run(groups())
    assert (group.min_policy_version, group.max_policy_version) == (0, 0)


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logprobs of ids[start:] under ``model`` (temperature 1, no filtering), one pass."""
    logits = model(ids[None]).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[start:, None])[:, 0]


@pytest.mark.ray
@pytest.mark.slow
def test_a_real_policy_updated_between_groups_yields_on_policy_groups(
    ray_session, untied_policy_dir
):
    """Strictly on-policy over a Ray-actor environment: the consumer pushes new weights after
    every group; each group it gets was generated wholly by the weights it then held, token
    for token (logprobs against teacher forcing by those weights)."""
    from transformers import AutoModelForCausalLM

    from envloop.environments.interfaces import actor_class

    policy = HfGeneration({"model_name": str(untied_policy_dir), "max_new_tokens": 8})
    tokenizer = policy.tokenizer
    weights = [AutoModelForCausalLM.from_pretrained(untied_policy_dir).eval()]
    generator = torch.Generator().manual_seed(5)
    for _ in range(3):
        model = AutoModelForCausalLM.from_pretrained(untied_policy_dir).eval()
        with torch.no_grad():
            for tensor in model.parameters():
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
        weights.append(model)
    env = actor_class(GuessNumberEnv, num_cpus=0).remote()
    rows = guess_rows(tokenizer, [10, 20, 30, 40])
    for row in rows:
        row["extra_env_info"]["max_guesses"] = 2

    async def train():
        stream = ExperienceStream(
            policy, rows, tokenizer, {"guess": env}, 256, group_size=2, max_staleness=0,
            max_concurrent_samples=4,
        )  # fmt: skip
        groups = []
        async for group in stream:
            groups.append((group, policy.policy_version))
            if policy.policy_version < 3:
                policy.update_weights(weights[policy.policy_version + 1].state_dict())
        return groups, stream.metrics()

    try:
        groups, metrics = asyncio.run(train())
    finally:
        ray_session.kill(env)
    assert sorted(g.indices for g, _ in groups) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [version for _, version in groups] == [0, 1, 2, 3]
    for group, version in groups:
        assert (group.min_policy_version, group.max_policy_version) == (version, version)
        for log in group.batch["message_log"]:
            ids = torch.cat([m["token_ids"] for m in log])
            start = 0
            for message in log:
                end = start + len(message["token_ids"])
                if message["role"] == "assistant":
                    assert message["generation_policy_versions"].tolist() == [version] * (
                        end - start
                    )
                    torch.testing.assert_close(
                        message["generation_logprobs"],
                        teacher_forced(weights[version], ids[:end], start),
                        atol=1e-4, rtol=0,
                    )  # fmt: skip
                start = end
    assert metrics["groups_yielded"] == 4 and metrics["max_staleness"] == 0
