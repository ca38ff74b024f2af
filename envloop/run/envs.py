"""The environments of a run: one Ray actor per task, started, checked, asked for their
metrics over finished samples, and stopped."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import is_actor
from envloop.environments.registry import create_env, get_env_class, list_envs, register_env
from envloop.run.config_checks import resolve_bundled
from envloop.run.config_sections import EnvConfig
from envloop.run.records import jsonable

_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)(: |$)")


class EnvStartError(RuntimeError):
    """An environment actor failed to start (its constructor raised, or did not return in
    time)."""


def start_envs(envs: Mapping[str, EnvConfig]) -> dict[str, Any]:
    """Task name -> an environment actor, starting in the background (Ray must be running;
    see :func:`wait_until_ready`). ``bundled:<name>`` strings in configs become the bundled
    model folders; ``num_cpus`` None reserves 0 CPUs, so any number of environments fit on
    a small machine; ``placement`` picks the nodes (``create_env``); other resources are
    the environment's own (``actor_options``, e.g. a
    reward model's ``resources.gpus_per_node``), refused at once when the Ray session has
    fewer GPUs (the actor would wait for them forever)."""
    handles: dict[str, Any] = {}
    try:
        for task, env in envs.items():
            if ":" in env.name and env.name not in list_envs():
                register_env(env.name, env.name)
            config = resolve_bundled(env.config)
            check_gpus(task, get_env_class(env.name).actor_options(config))
            num_cpus = env.num_cpus if env.num_cpus is not None else 0
            handles[task] = create_env(env.name, config, placement=env.placement, num_cpus=num_cpus)
    except BaseException:
        stop_envs(handles)
        raise
    return handles


def check_gpus(task: str, options: Mapping[str, Any]) -> None:
    """:class:`EnvStartError` when the actor options of ``envs.<task>`` ask for more GPUs
    than the Ray session has."""
    import ray

    wanted = float(options.get("num_gpus") or 0)
    available = float(ray.cluster_resources().get("GPU", 0))
    if wanted > available:
        raise EnvStartError(
            f"envs.{task}: the environment asks Ray for {wanted:g} GPU(s) but the Ray session "
            f"has {available:g}; set its config's resources (e.g. resources.gpus_per_node: 0 "
            "to run on CPU) or start envloop on a machine or cluster with GPUs."
        )


def wait_until_ready(
    handles: Mapping[str, Any], envs: Mapping[str, EnvConfig], timeout_s: float | None = None
) -> None:
    """Block until every actor has run its constructor, at most ``timeout_s`` seconds (None:
    no limit); :class:`EnvStartError` naming the task and the constructor's error when one
    failed, or the actors not started in time (a run whose environment never starts would
    only fail its samples, batch after batch)."""
    import ray

    refs = {task: handle.__ray_ready__.remote() for task, handle in handles.items()}
    _, waiting = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    late = [task for task, ref in refs.items() if ref in waiting]
    if late:
        names = ", ".join(f"envs.{t} ({envs[t].name!r})" for t in late)
        raise EnvStartError(
            f"{names} did not start within rollout.env_startup_timeout_s={timeout_s} s: the "
            "constructor is still running. Raise rollout.env_startup_timeout_s if it needs "
            "longer (loading a large reward model), or fix what it waits for."
        )
    for task, ref in refs.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise EnvStartError(
                f"envs.{task}: environment {envs[task].name!r} failed to start: "
                f"{_final_error(str(exc))}"
            ) from None


def _final_error(text: str) -> str:
    """The last ``SomeError: message`` of a Ray error's text (with its following lines),
    e.g. the ConfigError a constructor raised; the whole text if there is none."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    return "\n".join(lines[starts[-1] :]) if starts else text


def env_metrics(
    task_to_env: Mapping[str, Any], records: Sequence[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each task's ``global_post_process_and_metrics`` over its finished samples, from
    their records (messages as role/content, final ``extra_env_info``, rewards)."""
    metrics = {}
    for task, env in task_to_env.items():
        mine = [r for r in records if r["task"] == task]
        if not mine:
            continue
        batch = records_to_batch(mine)
        if is_actor(env):
            import ray

            _, result = ray.get(env.global_post_process_and_metrics.remote(batch))
        else:
            _, result = env.global_post_process_and_metrics(batch)
        metrics[task] = jsonable(result)
    return metrics


def records_to_batch(records: Sequence[Mapping[str, Any]]) -> BatchedDataDict[Any]:
    """A batch of finished samples as environments see them: ``message_log``
    (role/content), ``extra_env_info``, ``task_name``, ``total_reward`` / ``num_turns`` /
    ``truncated`` [B] and each ``reward/<name>`` component [B]."""
    batch: BatchedDataDict[Any] = BatchedDataDict(
        message_log=[[{"role": m["role"], "content": m["content"]} for m in r["messages"]]
                     for r in records],
        extra_env_info=[r["extra_env_info"] for r in records],
        task_name=[r["task"] for r in records],
        total_reward=torch.tensor([r["total_reward"] for r in records], dtype=torch.float32),
        num_turns=torch.tensor([r["num_turns"] for r in records], dtype=torch.long),
        truncated=torch.tensor([r["truncated"] for r in records], dtype=torch.bool),
    )  # fmt: skip
    for name in dict.fromkeys(k for r in records for k in r["rewards"]):
        values = [r["rewards"].get(name, 0.0) for r in records]
        batch[name] = torch.tensor(values, dtype=torch.float32)
    return batch


def stop_envs(handles: Mapping[str, Any]) -> None:
    """Call each environment's ``shutdown`` (best effort) and kill its actor."""
    import ray

    for handle in handles.values():
        with contextlib.suppress(Exception):  # a dead or stuck actor is killed all the same
            ray.get(handle.shutdown.remote(), timeout=30)
        ray.kill(handle)
