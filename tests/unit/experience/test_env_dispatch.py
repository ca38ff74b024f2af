"""EnvDispatcher: one step per task group, concurrently, failures kept as per-group data;
in-process environments on threads and Ray actors (marker ``ray``) alike."""

from __future__ import annotations

import threading

import pytest
from ray.exceptions import ActorDiedError

from envloop.environments.interfaces import EnvironmentReturn
from envloop.experience.env_dispatch import (
    EnvDispatcher,
    EnvironmentStepError,
    GroupResult,
    check_tasks_have_envs,
    group_by_task,
)
from tests.fixtures.envs import (
    BadContractEnv,
    CountdownEnv,
    DieOnceEnv,
    EchoEnv,
    FailingEnv,
    SlowEnv,
)
from tests.fixtures.restart_envs import DieOnceSlowRestartEnv
from tests.fixtures.sample_envs import HandshakeSampleEnv, SleepySampleEnv

TASKS = ["b", "a", "b", "a", "c"]
LOGS = [[{"role": "user", "content": f"q{i}"}] for i in range(5)]
METADATA = [{"reply": f"r{i}"} for i in range(5)]


def step(envs, task_names=TASKS, **options) -> list[GroupResult]:
    """One dispatcher step of every sample of ``task_names`` (EchoEnv replies r0, r1, ...)."""
    dispatcher = EnvDispatcher(envs, **options)
    try:
        groups = group_by_task(task_names, list(range(len(task_names))))
        return dispatcher.step(groups, LOGS[: len(task_names)], METADATA[: len(task_names)])
    finally:
        dispatcher.shutdown()


ACTOR_TIMEOUT = (
    "env {task}.step timed out after {s} s; its actor was killed for Ray to restart (Ray "
    "cannot stop a running step, and later steps would queue behind it)"
)


def replies(result: GroupResult) -> list[str]:
    assert result.error is None, result.error
    return [o["content"] for o in result.result.observations]


class MutatingEnv(EchoEnv):
    """Scribbles on the logs and metadata it receives before answering like EchoEnv."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        ret = super().step(message_log_batch, metadata)
        for log, md in zip(message_log_batch, metadata):
            log.append({"role": "environment", "content": "scribble"})
            md["reply"] = "changed"
        return ret


class BarrierEnv(EchoEnv):
    """Its step returns only once ``parties`` steps wait on the shared barrier together."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.barrier.wait()  # BrokenBarrierError after the barrier's timeout if alone
        return super().step(message_log_batch, metadata)


class BlockedEnv(EchoEnv):
    """Its step waits until the test releases it: no timeout can see it finish."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.release.wait()
        return super().step(message_log_batch, metadata)


class CountingFailEnv(EchoEnv):
    """Raises on every step and counts its steps."""

    def __init__(self) -> None:
        self.calls = 0

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.calls += 1
        raise RuntimeError("boom")


class LosesActorsEnv(EchoEnv):
    """Its first ``deaths`` steps raise ActorDiedError, as an environment whose own worker
    actor died would; then it answers like EchoEnv."""

    def __init__(self, deaths: int) -> None:
        self.deaths = deaths
        self.calls = 0

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.deaths:
            raise ActorDiedError()
        return super().step(message_log_batch, metadata)


class TupleEnv(EchoEnv):
    """Returns a plain 5-tuple instead of an EnvironmentReturn."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        return tuple(super().step(message_log_batch, metadata)[:5])


class DictEnv(EchoEnv):
    """Returns a dict instead of an EnvironmentReturn."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        return {"observations": []}


@pytest.fixture
def blocked():
    env = BlockedEnv()
    yield env
    env.release.set()


# Grouping and the task check


def test_groups_keep_the_order_of_first_appearance():
    assert group_by_task(TASKS, [0, 1, 2, 3, 4]) == {"b": [0, 2], "a": [1, 3], "c": [4]}
    assert group_by_task(TASKS, [3, 4, 0]) == {"a": [3], "c": [4], "b": [0]}
    assert group_by_task(TASKS, []) == {}


def test_known_tasks_pass_the_check():
    check_tasks_have_envs(TASKS, {"a": EchoEnv(), "b": EchoEnv(), "c": EchoEnv()})


def test_an_unknown_task_is_named_with_the_known_ones():
    with pytest.raises(ValueError) as info:
        check_tasks_have_envs(["guess", "gues", "mth"], {"calc": None, "guess": None})
    assert str(info.value) == (
        "No environment for task named 'gues'. Known: calc, guess. Did you mean 'guess'?"
    )


# In-process environments


def test_each_group_gets_its_own_samples_in_order():
    results = step({"a": EchoEnv(), "b": EchoEnv(), "c": EchoEnv()})
    assert [(r.task_name, r.indices) for r in results] == [("b", [0, 2]), ("a", [1, 3]), ("c", [4])]
    assert [replies(r) for r in results] == [["r0", "r2"], ["r1", "r3"], ["r4"]]


def test_no_groups_give_no_results():
    assert EnvDispatcher({"a": EchoEnv()}).step({}, [], []) == []


def test_in_process_environments_receive_copies():
    logs, metadata = [[{"role": "user", "content": "q"}]], [{"reply": "r"}]
    dispatcher = EnvDispatcher({"m": MutatingEnv()})
    [result] = dispatcher.step({"m": [0]}, logs, metadata)
    dispatcher.shutdown()
    assert replies(result) == ["r"]
    assert logs == [[{"role": "user", "content": "q"}]] and metadata == [{"reply": "r"}]


def test_groups_step_concurrently():
    barrier = threading.Barrier(2, timeout=30)  # both steps must wait on it at once
    results = step({"a": BarrierEnv(barrier), "b": BarrierEnv(barrier)}, ["a", "b"])
    assert [replies(r) for r in results] == [["r0"], ["r1"]]


def test_a_raising_environment_fails_only_its_group():
    results = step({"a": EchoEnv(), "b": FailingEnv(), "c": EchoEnv()})
    assert results[0].result is None
    assert results[0].error.startswith("env b.step raised:\nTraceback (most recent call last):")
    assert results[0].error.endswith("RuntimeError: boom: the failing environment always raises")
    assert [replies(r) for r in results[1:]] == [["r1", "r3"], ["r4"]]


def test_raise_mode_raises_the_first_failure():
    envs = {"a": EchoEnv(), "b": FailingEnv(), "c": EchoEnv()}
    with pytest.raises(EnvironmentStepError, match=r"^env b\.step raised:\nTraceback") as info:
        step(envs, on_error="raise")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_in_process_failures_are_not_retried():
    env = CountingFailEnv()
    [result] = step({"a": env}, ["a"], max_retries=3)
    assert env.calls == 1 and result.error.endswith("RuntimeError: boom")


def test_a_broken_contract_is_reported_with_every_problem():
    [result] = step({"a": BadContractEnv()}, ["a", "a"])
    assert result.result is None
    assert result.error == (
        "env a.step broke the EnvironmentReturn contract: observations: expected 2 entries "
        "(one per sample), got 1; rewards: expected a float tensor, got torch.int64"
    )


def test_a_plain_tuple_is_accepted_as_a_return():
    [result] = step({"a": TupleEnv()}, ["a", "a"])
    assert isinstance(result.result, EnvironmentReturn)
    assert replies(result) == ["r0", "r1"] and result.result.answers is None


def test_a_return_of_the_wrong_type_is_reported():
    [result] = step({"a": DictEnv()}, ["a"])
    assert (
        result.error == "env a.step: step() returned a dict; it must return an EnvironmentReturn."
    )


def test_a_step_past_the_timeout_fails_its_group(blocked):
    [result] = step({"slow": blocked}, ["slow"], timeout_s=0.2)
    assert result == GroupResult("slow", [0], None, "env slow.step timed out after 0.2 s")


def test_a_timeout_in_raise_mode_raises(blocked):
    with pytest.raises(EnvironmentStepError, match=r"^env slow\.step timed out after 0\.2 s$"):
        step({"slow": blocked}, ["slow"], timeout_s=0.2, on_error="raise")


def test_a_dispatcher_steps_again_after_shutdown():
    dispatcher = EnvDispatcher({"a": EchoEnv()})
    dispatcher.shutdown()
    dispatcher.shutdown()
    [result] = dispatcher.step({"a": [0]}, LOGS, METADATA)
    dispatcher.shutdown()
    assert replies(result) == ["r0"]


@pytest.mark.parametrize(("deaths", "max_retries"), [(1, 1), (1, 3), (2, 2)])
def test_a_step_that_lost_an_actor_is_retried(deaths, max_retries):
    env = LosesActorsEnv(deaths)
    [result] = step({"a": env}, ["a"], max_retries=max_retries)
    assert replies(result) == ["r0"] and env.calls == deaths + 1


def test_a_step_that_loses_actors_past_its_retries_fails_its_group():
    env = LosesActorsEnv(deaths=2)
    [result] = step({"a": env}, ["a"], max_retries=1)
    assert env.calls == 2
    assert result.error.startswith("env a.step raised:\nTraceback")
    assert result.error.endswith("The actor died unexpectedly before finishing this task.")


# Ray actors


@pytest.fixture
def actors(ray_session):
    """Start actors with ``actors(env_class, *args, **ray_options)``; killed after the test."""
    started = []

    def start(env_class, *args, **ray_options):
        handle = env_class.options(num_cpus=0, **ray_options).remote(*args)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        ray_session.kill(handle)


@pytest.mark.ray
def test_actor_groups_get_their_own_samples_in_order(actors):
    results = step({t: actors(EchoEnv) for t in "abc"})
    assert [(r.task_name, r.indices) for r in results] == [("b", [0, 2]), ("a", [1, 3]), ("c", [4])]
    assert [replies(r) for r in results] == [["r0", "r2"], ["r1", "r3"], ["r4"]]


@pytest.mark.ray
def test_a_raising_actor_fails_only_its_group_with_the_remote_traceback(actors):
    results = step({"a": actors(EchoEnv), "b": actors(FailingEnv), "c": actors(EchoEnv)})
    error = results[0].error
    assert error.startswith("env b.step raised:\n") and "FailingEnv.step()" in error
    assert error.endswith("RuntimeError: boom: the failing environment always raises")
    assert [replies(r) for r in results[1:]] == [["r1", "r3"], ["r4"]]


@pytest.mark.ray
def test_a_raising_actor_in_raise_mode_raises(actors):
    with pytest.raises(EnvironmentStepError, match=r"(?s)^env a\.step raised:.*boom"):
        step({"a": actors(FailingEnv)}, ["a"], on_error="raise")


@pytest.mark.ray
def test_an_actor_past_the_timeout_fails_its_group(actors):
    [result] = step({"slow": actors(SlowEnv, 600.0)}, ["slow"], timeout_s=0.5)
    assert result == GroupResult("slow", [0], None, ACTOR_TIMEOUT.format(task="slow", s=0.5))


# Ray's own task retries are off (max_task_retries=0), so only the dispatcher retries.


@pytest.mark.ray
def test_a_dead_actor_is_restarted_and_its_step_retried(actors, tmp_path):
    marker = tmp_path / "died"
    env = actors(DieOnceSlowRestartEnv, str(marker), 2.0, max_restarts=1, max_task_retries=0)
    [result] = step({"a": env}, ["a"], max_retries=1)
    assert marker.exists()  # the first step killed the actor
    assert result.error is None, result.error.splitlines()[-1]
    assert replies(result) == ["r0"] and result.result.terminateds.tolist() == [True]


@pytest.mark.ray
def test_a_dead_actor_without_retries_fails_its_group(actors, tmp_path):
    env = actors(DieOnceEnv, str(tmp_path / "died"), max_restarts=1, max_task_retries=0)
    [result] = step({"a": env}, ["a"], max_retries=0)
    assert result.result is None and result.error.startswith("env a.step raised:\n")
    assert "ray.exceptions.Actor" in result.error  # ActorDiedError or ActorUnavailableError


@pytest.mark.ray
def test_a_retry_on_an_actor_that_stays_dead_fails_its_group(actors, tmp_path):
    env = actors(DieOnceEnv, str(tmp_path / "died"), max_restarts=0, max_task_retries=0)
    [result] = step({"a": env}, ["a"], max_retries=1)
    assert result.result is None and "ray.exceptions.ActorDiedError" in result.error


@pytest.mark.ray
def test_a_constructor_error_surfaces_as_the_groups_first_step_error(actors):
    envs = {"a": actors(EchoEnv), "b": actors(CountdownEnv, {"start": 0})}
    results = step(envs, ["a", "b"])
    assert replies(results[0]) == ["r0"]
    assert results[1].result is None and results[1].error.startswith("env b.step raised:\n")
    assert "start: must be >= 1, got 0" in results[1].error


@pytest.mark.ray
def test_an_infinite_timeout_is_no_limit(actors):
    [result] = step({"a": actors(EchoEnv)}, ["a"], timeout_s=float("inf"))
    assert result.error is None, result.error.splitlines()[-1]


# Streaming per sample (SampleEnvironment.step_stream)


def stream_all(env, sleeps: list[float], timeout_s: float | None = None) -> list[GroupResult]:
    """Step ``env`` as task ``s`` on one sample per sleep; every delivered result, in order."""
    dispatcher = EnvDispatcher({"s": env}, timeout_s=timeout_s)
    delivered: list[GroupResult] = []
    try:
        assert dispatcher.streams("s")
        samples = list(range(len(sleeps)))
        metadata = [{"sleep_s": s} for s in sleeps]
        dispatcher.step_stream("s", samples, LOGS[: len(sleeps)], metadata, delivered.append)
    finally:
        dispatcher.shutdown()
    return delivered


def assert_late_sample_timed_out_alone(delivered: list[GroupResult], error: str) -> None:
    assert sorted(r.indices[0] for r in delivered[:2]) == [0, 2]
    assert all(r.result is not None and r.result.rewards.tolist() == [1.0] for r in delivered[:2])
    (late,) = delivered[2:]
    assert late.indices == [1] and late.result is None
    assert late.error == error


def test_a_streaming_environment_delivers_each_sample_and_times_out_only_the_late_one():
    env = SleepySampleEnv()
    try:
        delivered = stream_all(env, [0.0, 60.0, 0.01], timeout_s=2.0)
        assert_late_sample_timed_out_alone(delivered, "env s.step timed out after 2.0 s")
    finally:
        env.shutdown()


def test_a_batched_environment_does_not_stream():
    assert not EnvDispatcher({"e": EchoEnv()}).streams("e")


@pytest.mark.ray
def test_a_streaming_actor_delivers_each_sample_and_times_out_only_the_late_one(actors):
    env = actors(SleepySampleEnv)
    delivered = stream_all(env, [0.0, 60.0, 0.01], timeout_s=2.0)
    assert_late_sample_timed_out_alone(delivered, ACTOR_TIMEOUT.format(task="s", s=2.0))


@pytest.mark.ray
def test_calls_to_one_streaming_actor_overlap(actors):
    """The first call's sample waits for the second call's: both finish only if the actor
    runs the two calls at once."""
    env = actors(HandshakeSampleEnv)
    dispatcher = EnvDispatcher({"h": env}, timeout_s=60)
    delivered: dict[str, list[GroupResult]] = {"wait": [], "set": []}

    def call(role: str, sample: int) -> None:
        logs, metadata = [[], []], [role, role]
        dispatcher.step_stream("h", [sample], logs, metadata, delivered[role].append)

    waiting = threading.Thread(target=call, args=("wait", 0))
    waiting.start()
    call("set", 1)
    waiting.join()
    for role in ("wait", "set"):
        (result,) = delivered[role]
        assert result.error is None and result.result.observations[0]["content"] == role
