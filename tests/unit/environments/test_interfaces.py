"""EnvironmentInterface as NeMo-RL code uses it: ``Env.remote(cfg)``, ``Env.options(...)``,
``EnvironmentInterface[Metadata]`` and ``EnvironmentReturn[Metadata]``."""

from __future__ import annotations

import logging
from typing import TypedDict

import pytest
import torch

from envloop.environments.interfaces import (
    DEFAULT_ACTOR_OPTIONS,
    EnvironmentInterface,
    EnvironmentReturn,
    actor_class,
)
from tests.fixtures.envs import DieOnceEnv, EchoEnv

LOG = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


class _Metadata(TypedDict):
    reply: str


class _TypedEchoEnv(EnvironmentInterface[_Metadata]):
    def step(self, message_log_batch, metadata: list[_Metadata]) -> EnvironmentReturn[_Metadata]:
        return EnvironmentReturn[_Metadata](
            observations=[{"role": "environment", "content": md["reply"]} for md in metadata],
            metadata=metadata,
            next_stop_strings=[None] * len(metadata),
            rewards=torch.ones(len(metadata)),
            terminateds=torch.ones(len(metadata), dtype=torch.bool),
            answers=None,
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


def test_nemo_style_generic_subscripts_work_in_process():
    ret = _TypedEchoEnv().step([LOG], [{"reply": "ok"}])
    assert type(ret) is EnvironmentReturn
    assert ret.observations == [{"role": "environment", "content": "ok"}]


def test_instances_have_no_actor_constructors():
    env = EchoEnv()
    assert not hasattr(env, "remote") and not hasattr(env, "options")
    assert env.step([LOG], [{"reply": "x"}]).observations[0]["content"] == "x"


@pytest.mark.ray
def test_class_remote_starts_an_actor(ray_session):
    actor = EchoEnv.remote()  # (workers import envs from tests.fixtures, not test modules)
    ret = ray_session.get(actor.step.remote([LOG], [{"reply": "from an actor"}]))
    assert ret.observations == [{"role": "environment", "content": "from an actor"}]
    assert not hasattr(actor, "remote") and not hasattr(actor, "options")
    ray_session.kill(actor)


@pytest.mark.ray
def test_options_override_the_default_restarts(ray_session, tmp_path):
    assert DEFAULT_ACTOR_OPTIONS == {"max_restarts": -1, "max_task_retries": 3}
    restarted = DieOnceEnv.remote(str(tmp_path / "restarted"))
    ret = ray_session.get(restarted.step.remote([LOG], [{"reply": "again"}]))
    assert ret.observations[0]["content"] == "again"  # died once, restarted, step retried

    no_restarts = DieOnceEnv.options(max_restarts=0, num_cpus=0).remote(str(tmp_path / "dead"))
    with pytest.raises(ray_session.exceptions.RayActorError):
        ray_session.get(no_restarts.step.remote([LOG], [{"reply": "never"}]))
    assert (tmp_path / "dead").exists()
    ray_session.kill(restarted)


@pytest.mark.ray
def test_making_an_actor_class_logs_no_override_note(ray_session):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    ray_actor_logger = logging.getLogger("ray.actor")
    ray_actor_logger.addHandler(handler)
    try:
        actor_class(EchoEnv)
        EchoEnv.options(num_cpus=0)
    finally:
        ray_actor_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []
    assert ray_actor_logger.filters == []  # the filter is gone again
