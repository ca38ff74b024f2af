"""SampleEnvironment: one sample's step in, the batched contract out; failures stay per sample."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from envloop.environments import (
    EnvironmentContractError,
    SampleEnvironment,
    SampleStep,
    check_env,
    create_env,
    register_env,
)
from envloop.environments.checker import MissingMetadataError
from envloop.environments.contract import env_return_problems
from envloop.environments.interfaces import EnvironmentReturn
from envloop.experience.rollouts import EnvironmentStepError, run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.sample_envs import AsyncSecretWordEnv, SecretWordEnv


def log(response: str) -> list[dict]:
    return [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": response}]


def word(w: str, tries: int = 0, **extra) -> dict:
    return {"word": w, "tries": tries, **extra}


# --- the batched step ------------------------------------------------------------------------


def test_a_sync_environment_steps_every_sample_in_order():
    ret = SecretWordEnv().step([log("apple"), log("plum"), log("pear")], [
        word("apple"), word("pear"), word("pear", tries=1),
    ])  # fmt: skip
    assert ret.observations == [
        {"role": "environment", "content": "correct"},
        {"role": "environment", "content": "try again"},
        {"role": "environment", "content": "correct"},
    ]
    assert ret.metadata == [word("apple", 1), word("pear", 1), word("pear", 2)]
    assert ret.next_stop_strings == [None, ["</w>"], None]
    assert (ret.rewards.dtype, ret.rewards.tolist()) == (torch.float32, [1.0, 0.0, 1.0])
    assert (ret.terminateds.dtype, ret.terminateds.tolist()) == (torch.bool, [True, False, True])
    assert ret.answers == ["apple", "plum", "pear"]
    assert ret.errors is None
    assert env_return_problems(ret, 3) == []


class Minimal(SampleEnvironment):
    """Only observation, reward and terminated; a role of its own."""

    observation_role = "tool"

    def step_sample(self, messages, metadata):
        return SampleStep(messages[-1]["content"][::-1], len(messages[-1]["content"]), False)


def test_defaults_metadata_unchanged_no_stop_strings_no_answer_and_no_metrics():
    env, metadata = Minimal(), [{"keep": [1]}, None]
    ret = env.step([log("abc"), log("hello")], metadata)
    assert ret == EnvironmentReturn(
        observations=[{"role": "tool", "content": "cba"}, {"role": "tool", "content": "olleh"}],
        metadata=metadata,
        next_stop_strings=[None, None],
        rewards=ret.rewards,
        terminateds=ret.terminateds,
        answers=[None, None],
        errors=None,
    )
    assert ret.metadata[0] is metadata[0]  # unchanged: the very object it came with
    assert ret.rewards.tolist() == [3.0, 5.0] and ret.terminateds.tolist() == [False, False]
    assert env.global_post_process_and_metrics("batch") == ("batch", {})


class Parts(SampleEnvironment):
    """Components from the response: "a=0.5 b=1" -> {"a": 0.5, "b": 1.0}; "7" -> reward 7."""

    def step_sample(self, messages, metadata):
        text = messages[-1]["content"]
        if "=" not in text:
            return SampleStep({"role": "user", "content": "plain"}, float(text), True)
        parts = {k: float(v) for k, v in (p.split("=") for p in text.split())}
        return SampleStep("parts", reward_components=parts, terminated=True)


def test_reward_components_become_the_reward_dict_of_the_contract():
    ret = Parts().step([log("a=0.5 b=1"), log("b=2 reward/c=3"), log("7")], [None] * 3)
    assert list(ret.rewards) == ["reward/a", "reward/b", "reward/c", "reward/scalar"]
    assert {k: v.tolist() for k, v in ret.rewards.items()} == {
        "reward/a": [0.5, 0.0, 0.0],
        "reward/b": [1.0, 2.0, 0.0],
        "reward/c": [0.0, 3.0, 0.0],
        "reward/scalar": [0.0, 0.0, 7.0],  # a single reward among components
    }
    assert all(v.dtype == torch.float32 and v.shape == (3,) for v in ret.rewards.values())
    assert ret.observations[2] == {"role": "user", "content": "plain"}
    assert env_return_problems(ret, 3) == []


def test_an_empty_batch():
    ret = SecretWordEnv().step([], [])
    assert (ret.observations, ret.metadata, ret.next_stop_strings, ret.answers) == ([], [], [], [])
    assert (ret.rewards.dtype, tuple(ret.rewards.shape)) == (torch.float32, (0,))
    assert (ret.terminateds.dtype, tuple(ret.terminateds.shape)) == (torch.bool, (0,))
    assert ret.errors is None


def test_extra_step_arguments_are_accepted():
    ret = SecretWordEnv().step([log("a")], [word("a")], return_extracted_answer=True)
    assert ret.rewards.tolist() == [1.0]


# --- concurrency -----------------------------------------------------------------------------


class AllTogether(SampleEnvironment):
    """Every sample waits until all ``n`` have started: the batch finishes only when all of
    its samples run at once (else each waits out the guard and fails)."""

    def __init__(self, n: int) -> None:
        self.n, self.started = n, 0
        self.all_started: asyncio.Event | None = None

    async def astep_sample(self, messages, metadata):
        if self.all_started is None:
            self.all_started = asyncio.Event()
        self.started += 1
        if self.started == self.n:
            self.all_started.set()
        await asyncio.wait_for(self.all_started.wait(), timeout=30)  # a guard, not a timing
        return SampleStep(messages[-1]["content"], metadata, True)


def test_async_samples_run_concurrently_and_keep_their_order():
    env = AllTogether(4)
    try:
        ret = env.step([log(str(i)) for i in range(4)], [0.0, 1.0, 2.0, 3.0])
    finally:
        env.shutdown()
    assert [o["content"] for o in ret.observations] == ["0", "1", "2", "3"]
    assert ret.rewards.tolist() == [0.0, 1.0, 2.0, 3.0] and ret.errors is None


class Counted(SampleEnvironment):
    """Records the most samples in flight at once."""

    max_concurrent_samples = 2

    def __init__(self) -> None:
        self.running = self.peak = 0

    async def astep_sample(self, messages, metadata):
        self.running += 1
        self.peak = max(self.peak, self.running)
        for _ in range(3):
            await asyncio.sleep(0)
        self.running -= 1
        return SampleStep("ok", 1.0, True)


def test_max_concurrent_samples_bounds_the_async_samples_in_flight():
    env = Counted()
    try:
        assert env.step([log("x")] * 6, [None] * 6).rewards.tolist() == [1.0] * 6
    finally:
        env.shutdown()
    assert env.peak == 2


class Threaded(SampleEnvironment):
    """Sync samples over 3 threads; each waits at a barrier for the other two."""

    max_concurrent_samples = 3

    def __init__(self) -> None:
        self.barrier = threading.Barrier(3, timeout=30)

    def step_sample(self, messages, metadata):
        self.barrier.wait()
        return SampleStep(threading.current_thread().name, metadata, True)


def test_a_thread_pool_runs_sync_samples_concurrently_and_keeps_their_order():
    ret = Threaded().step([log("x")] * 3, [0.0, 1.0, 2.0])
    assert ret.rewards.tolist() == [0.0, 1.0, 2.0] and ret.errors is None
    names = {o["content"] for o in ret.observations}
    assert len(names) == 3 and all(n.startswith("envloop-sample") for n in names)


class WhereAmI(SampleEnvironment):
    def step_sample(self, messages, metadata):
        return SampleStep(threading.current_thread().name, 0.0)


def test_sync_samples_run_in_the_callers_thread_by_default():
    ret = WhereAmI().step([log("a"), log("b")], [None, None])
    assert [o["content"] for o in ret.observations] == ["MainThread", "MainThread"]


def test_an_async_environment_steps_from_a_running_loop_and_from_a_plain_thread():
    env = AsyncSecretWordEnv()

    async def from_a_coroutine():
        return env.step([log("kiwi")], [word("kiwi")])

    results = []
    thread = threading.Thread(target=lambda: results.append(env.step([log("no")], [word("x")])))
    try:
        assert asyncio.run(from_a_coroutine()).rewards.tolist() == [1.0]
        thread.start()
        thread.join()
    finally:
        env.shutdown()
    assert results[0].observations[0]["content"] == "try again"
    assert "_sample_loop" not in env.__dict__


# --- failures are data -----------------------------------------------------------------------


@pytest.mark.parametrize("env_class", [SecretWordEnv, AsyncSecretWordEnv])
def test_a_sample_that_raises_fails_alone(env_class):
    env = env_class()
    metadata = [word("a"), word("b", explode="once"), word("c")]
    try:
        ret = env.step([log("a"), log("b"), log("no")], metadata)
    finally:
        env.shutdown()
    method = "astep_sample" if env_class is AsyncSecretWordEnv else "step_sample"
    assert ret.errors[0] is None and ret.errors[2] is None
    first, *trace = ret.errors[1].splitlines()
    assert first == f"{env_class.__name__}.{method} raised RuntimeError: exploded on purpose: once"
    assert trace[0] == "Traceback (most recent call last):"
    assert trace[-1] == "RuntimeError: exploded on purpose: once"
    # The failed sample's placeholders: empty observation, metadata unchanged, 0, ended.
    assert ret.observations[1] == {"role": "environment", "content": ""}
    assert ret.metadata[1] is metadata[1] and ret.next_stop_strings[1] is None
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0]
    assert ret.terminateds.tolist() == [True, True, False]
    assert ret.answers == ["a", None, "no"]
    assert env_return_problems(ret, 3) == []


def test_a_failed_sample_gets_zero_for_every_component():
    ret = Parts().step([log("a=1"), log("a=oops")], [None, None])
    assert {k: v.tolist() for k, v in ret.rewards.items()} == {"reward/a": [1.0, 0.0]}
    assert ret.errors[1].startswith("Parts.step_sample raised ValueError: could not convert")


def test_a_thread_pool_sample_that_raises_fails_alone():
    class Pool(SecretWordEnv):
        max_concurrent_samples = 4

    ret = Pool().step([log("a")] * 3, [word("a"), word("a", explode="x"), word("z")])
    assert [e is None for e in ret.errors] == [True, False, True]
    assert ret.rewards.tolist() == [1.0, 0.0, 0.0]


def test_when_every_sample_fails_step_raises_the_first_samples_exception():
    metadata = [word("a", explode="first"), word("b", explode="second")]
    with pytest.raises(RuntimeError, match="exploded on purpose: first"):
        SecretWordEnv().step([log("a"), log("b")], metadata)
    with pytest.raises(KeyError, match="'word'"):
        SecretWordEnv().step([log("a")], [{"tries": 0}])


class Careless(SampleEnvironment):
    def step_sample(self, messages, metadata):
        if metadata == "dict":
            return {"observation": "x", "reward": 1.0}
        if metadata == "numpy-ish":
            return SampleStep("x", reward=1.0, terminated=1)
        return SampleStep("fine", 1.0, True)


def test_a_result_that_is_not_a_valid_sample_step_fails_its_sample():
    ret = Careless().step([log("a")] * 3, ["dict", "numpy-ish", None])
    assert [e.splitlines()[0] if e else None for e in ret.errors] == [
        "Careless.step_sample raised TypeError: Careless.step_sample returned a dict; it must "
        "return a SampleStep.",
        "Careless.step_sample raised ValueError: invalid SampleStep: terminated must be a bool, "
        "got int (1); use bool(...)",
        None,
    ]


def test_sample_step_reports_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        SampleStep({"role": "user"}, terminated="yes", next_stop_strings=[""], answer=3)
    assert str(info.value) == (
        "invalid SampleStep: observation must be a str or {'role': str, 'content': str or a "
        "list of text/image parts}, got {'role': 'user'}; give exactly one of reward and "
        "reward_components; terminated must be a bool, got str ('yes'); use bool(...); "
        "next_stop_strings must be None or a list of non-empty str, got ['']; answer must be "
        "a str or None, got int"
    )
    with pytest.raises(ValueError, match="give exactly one of reward and reward_components"):
        SampleStep("x", 1.0, reward_components={"a": 1.0})
    with pytest.raises(ValueError, match=re.escape("reward_components['a']: expected a str")):
        SampleStep("x", reward_components={"a": "1"})
    with pytest.raises(ValueError, match="reward must be a number, got '1'"):
        SampleStep("x", "1")


def test_a_class_with_neither_method_says_so():
    class Nothing(SampleEnvironment):
        pass

    with pytest.raises(NotImplementedError, match="Nothing implements neither step_sample nor"):
        Nothing().step([log("a")], [None])


def test_a_bad_max_concurrent_samples_is_a_clear_error():
    env = Minimal()
    env.max_concurrent_samples = 0
    with pytest.raises(ValueError, match="max_concurrent_samples must be None or an int >= 1"):
        env.step([log("a")], [None])


def test_the_contract_checks_errors():
    ok = SecretWordEnv().step([log("a")], [word("a")])
    assert env_return_problems(ok._replace(errors=["x", None]), 1) == [
        "errors: expected 1 entries (one per sample), got 2"
    ]
    assert env_return_problems(ok._replace(errors=[""]), 1) == [
        "errors[0]: expected None or a non-empty str, got ''"
    ]


# --- in a rollout ----------------------------------------------------------------------------


def say_the_word(prompt: str) -> str:
    return re.findall(r"Say (\w+)", prompt)[-1]


def word_batch(tokenizer):
    return make_batch(tokenizer, [
        {"task": "word", "prompt": "Say apple", "metadata": word("apple")},
        {"task": "word", "prompt": "Say bread", "metadata": word("bread", explode="on turn 1")},
        {"task": "word", "prompt": "Say plum", "metadata": word("pear")},
    ])  # fmt: skip


@pytest.mark.parametrize("env_class", [SecretWordEnv, AsyncSecretWordEnv])
def test_in_a_rollout_a_failing_sample_is_recorded_on_that_sample_only(tiny_tokenizer, env_class):
    policy = ScriptedGeneration(tiny_tokenizer, say_the_word)
    env = env_class()
    try:
        final, metrics = run_multi_turn_rollout(
            policy, word_batch(tiny_tokenizer), tiny_tokenizer, {"word": env}, max_seq_len=512
        )
    finally:
        env.shutdown()
    method = "astep_sample" if env_class is AsyncSecretWordEnv else "step_sample"
    errors = final["env_error"]
    assert errors[0] is None and errors[2] is None
    assert errors[1].splitlines()[0] == (
        f"env word: {env_class.__name__}.{method} raised RuntimeError: exploded on purpose: "
        "on turn 1"
    )
    assert "Traceback (most recent call last):" in errors[1]
    assert [[m["role"] for m in log] for log in final["message_log"]] == [
        ["user", "assistant", "environment"],
        ["user", "assistant"],  # no observation for the failed sample
        ["user", "assistant", "environment", "assistant", "environment"],
    ]
    assert final["message_log"][2][-1]["content"] == "try again"
    assert final["total_reward"].tolist() == [1.0, 0.0, 0.0]
    assert final["turn_rewards"] == [[1.0], [0.0], [0.0, 0.0]]
    assert final["loss_multiplier"] == [1.0, 0.0, 1.0]
    assert final["terminated"].tolist() == [True, False, True]
    assert [md["tries"] for md in final["extra_env_info"]] == [1, 0, 2]
    assert metrics["env_error_rate"] == pytest.approx(1 / 3)
    assert metrics["natural_termination_rate"] == pytest.approx(2 / 3)


def test_in_a_rollout_components_and_failures_together(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: re.findall(r"\[(.*?)\]", prompt)[-1])
    batch = make_batch(tiny_tokenizer, [
        {"task": "parts", "prompt": "[a=0.5 b=1]"}, {"task": "parts", "prompt": "[a=bad]"},
    ])  # fmt: skip
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"parts": Parts()}, 512)
    assert final["reward/a"].tolist() == [0.5, 0.0] and final["reward/b"].tolist() == [1.0, 0.0]
    assert final["reward_components"] == [["reward/a", "reward/b"], []]
    assert final["total_reward"].tolist() == [1.5, 0.0]
    assert final["env_error"][0] is None and "ValueError" in final["env_error"][1]


def test_on_env_error_raise_raises_the_samples_error(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, say_the_word)
    with pytest.raises(EnvironmentStepError) as info:
        run_multi_turn_rollout(
            policy, word_batch(tiny_tokenizer), tiny_tokenizer, {"word": SecretWordEnv()}, 512,
            on_env_error="raise",
        )  # fmt: skip
    assert str(info.value).startswith(
        "env word: SecretWordEnv.step_sample raised RuntimeError: exploded on purpose: on turn 1"
    )


# --- the contract checker and Ray ------------------------------------------------------------

CHECK_LOGS = [log("apple"), log("plum")]
CHECK_METADATA = [word("apple"), word("pear")]


def test_check_env_passes_and_reports_failing_samples():
    ret = check_env(SecretWordEnv(), CHECK_LOGS, CHECK_METADATA)
    assert ret.rewards.tolist() == [1.0, 0.0]
    with pytest.raises(EnvironmentContractError) as info:
        check_env(SecretWordEnv(), CHECK_LOGS, [word("apple"), word("pear", explode="here")])
    assert info.value.problems == [
        "sample 1: SecretWordEnv.step_sample raised RuntimeError: exploded on purpose: here"
    ]
    with pytest.raises(MissingMetadataError) as missing:
        check_env(SecretWordEnv(), CHECK_LOGS, [{"tries": 0}, {"tries": 0}])
    assert (missing.value.key, missing.value.present) == ("word", ["tries"])


@pytest.mark.ray
@pytest.mark.parametrize("env_class", [SecretWordEnv, AsyncSecretWordEnv])
def test_as_a_ray_actor(ray_session, tiny_tokenizer, env_class):
    name = f"test_sample_{env_class.__name__}"
    register_env(name, f"tests.fixtures.sample_envs:{env_class.__name__}", overwrite=True)
    actor = create_env(name, num_cpus=0)
    try:
        ret = check_env(actor, CHECK_LOGS, CHECK_METADATA)
        assert ret.rewards.tolist() == [1.0, 0.0] and ret.terminateds.tolist() == [True, False]
        policy = ScriptedGeneration(tiny_tokenizer, say_the_word)
        final, _ = run_multi_turn_rollout(
            policy, word_batch(tiny_tokenizer), tiny_tokenizer, {"word": actor}, max_seq_len=512
        )
        assert [e is None for e in final["env_error"]] == [True, False, True]
        assert "exploded on purpose" in final["env_error"][1]
        assert final["total_reward"].tolist() == [1.0, 0.0, 0.0]
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


# --- streaming: each sample as it finishes ---------------------------------------------------


class Ordered(SampleEnvironment):
    """Sample ``i`` finishes only after sample ``metadata`` (its predecessor in a chain)."""

    def __init__(self) -> None:
        self.done: dict[int, asyncio.Event] = {}

    async def astep_sample(self, messages, metadata):
        me, after = metadata
        event = self.done.setdefault(me, asyncio.Event())
        if after is not None:
            await asyncio.wait_for(self.done.setdefault(after, asyncio.Event()).wait(), 30)
        if me == 1:
            raise KeyError("sample one fails")
        event.set()
        return SampleStep(f"done {me}", float(me), True, metadata={"me": me})


def per_row(items) -> tuple[list[int], dict[int, EnvironmentReturn]]:
    """The rows in the order they came, and each row's own one-row return."""
    order, returns = [], {}
    for rows, ret in items:
        assert env_return_problems(ret, len(rows)) == [] and rows == sorted(rows)
        for j, row in enumerate(rows):
            order.append(row)
            returns[row] = select_one(ret, j)
    return order, returns


def select_one(ret: EnvironmentReturn, j: int) -> EnvironmentReturn:
    return EnvironmentReturn(
        [ret.observations[j]], [ret.metadata[j]], [ret.next_stop_strings[j]],
        ret.rewards[j : j + 1], ret.terminateds[j : j + 1],
        None if ret.answers is None else [ret.answers[j]],
        None if ret.errors is None else [ret.errors[j]],
    )  # fmt: skip


def assert_chain_streamed(items) -> None:
    order, returns = per_row(items)
    item_of = {row: k for k, (rows, _) in enumerate(items) for row in rows}
    assert sorted(order) == [0, 1, 2, 3]
    assert item_of[3] <= item_of[2] <= item_of[0]  # never before the sample it waits for
    for row in (0, 2, 3):
        ret = returns[row]
        assert ret.errors in (None, [None])
        assert ret.observations == [{"role": "environment", "content": f"done {row}"}]
        assert ret.rewards.tolist() == [float(row)] and ret.metadata == [{"me": row}]
    failed = returns[1]
    assert failed.errors is not None and "sample one fails" in failed.errors[0]
    assert failed.terminateds.tolist() == [True] and failed.metadata == [(1, None)]


CHAIN = [(0, 2), (1, None), (2, 3), (3, None)]  # finish order: 1 (fails), 3, 2, 0


def test_step_stream_yields_samples_as_they_finish_with_failures_as_data():
    env = Ordered()
    try:
        assert_chain_streamed(list(env.step_stream([log("x")] * 4, CHAIN)))
    finally:
        env.shutdown()


def test_astep_stream_yields_what_step_stream_yields():
    async def collect(env, logs, metadata):
        return [item async for item in env.astep_stream(logs, metadata)]

    env = Ordered()
    try:
        assert_chain_streamed(asyncio.run(collect(env, [log("x")] * 4, CHAIN)))
    finally:
        env.shutdown()
    for streamed in (
        asyncio.run(collect(Threaded(), [log("x")] * 3, [0.0, 1.0, 2.0])),
        list(Threaded().step_stream([log("x")] * 3, [0.0, 1.0, 2.0])),
    ):
        order, returns = per_row(streamed)
        assert sorted(order) == [0, 1, 2]
        assert [returns[r].rewards.tolist() for r in range(3)] == [[0.0], [1.0], [2.0]]
    for streamed in (
        asyncio.run(collect(SecretWordEnv(), CHECK_LOGS, CHECK_METADATA)),
        list(SecretWordEnv().step_stream(CHECK_LOGS, CHECK_METADATA)),
    ):
        order, returns = per_row(streamed)
        assert order == [0, 1]  # one sample at a time, in order
        assert [returns[r].rewards.tolist() for r in order] == [[1.0], [0.0]]
