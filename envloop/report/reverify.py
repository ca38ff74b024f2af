"""Re-score a run's stored rollouts with the current environments and report what changed.

The replay: each sample's environment is stepped once per stored assistant turn, on the
stored conversation up to and including that turn (``role`` and ``content`` only, what
environments receive; an image part's ``image`` is the path of its file in the run
directory), with the metadata that environment returned on the previous replayed
step; the first step gets the sample's initial metadata (``initial_extra_env_info`` when the
record has it, else ``extra_env_info``). Samples are stepped in one batch per task per turn,
as in a rollout; a batch whose step fails is retried one sample at a time, so a failure is
charged to the samples that cause it. Responses and observations stay as stored: only rewards
and errors are recomputed. When the current environment ends an episode before the stored
one did, the later turns are not scored (the policy would never have written them).

Each sample gets a status: ``same``; ``changed`` (a turn's reward differs by more than
:data:`REWARD_TOLERANCE`, or the episode now ends after fewer turns); ``error_fixed`` (its
stored step failed, the replay did not); ``new_error``; or ``still_error``. The summary
(:func:`envloop.report.reverify_summary.summarize`) counts them per task and lists the changes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from envloop.distributed.ray_utils import is_actor
from envloop.environments.registry import create_env, list_envs, register_env
from envloop.experience.env_dispatch import EnvDispatcher, check_tasks_have_envs, group_by_task
from envloop.report.reverify_summary import format_reverify, summarize
from envloop.run.config_checks import resolve_bundled, resolve_env_class
from envloop.run.files import load_config, load_rollouts

__all__ = ["REVERIFY_FILE", "build_task_envs", "format_reverify", "reverify_run"]

REWARD_TOLERANCE = 1e-6
REVERIFY_FILE = "reverify.json"


@dataclass
class _Replay:
    """One sample's replay: its stored conversation and what the current environment said."""

    record: dict[str, Any]
    view: list[dict[str, Any]]  # role/content of every stored message
    assistant_at: list[int]  # positions of the assistant messages in ``view``
    metadata: Any
    turn_rewards: list[float] = field(default_factory=list)
    components: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    terminated: bool = False

    @classmethod
    def start(cls, record: dict[str, Any], run_dir: Path) -> _Replay:
        view = [
            {"role": m["role"], "content": _with_image_paths(m["content"], run_dir)}
            for m in record["messages"]
        ]
        metadata = record.get("initial_extra_env_info", record.get("extra_env_info"))
        at = [i for i, m in enumerate(view) if m["role"] == "assistant"]
        return cls(record, view, at, metadata)

    def takes_turn(self, k: int) -> bool:
        return self.error is None and not self.terminated and k < len(self.assistant_at)

    def conversation(self, k: int) -> list[dict[str, Any]]:
        return self.view[: self.assistant_at[k] + 1]


def reverify_run(
    run_dir: str | Path,
    task_to_env: dict[str, Any] | None = None,
    *,
    use_ray: bool = False,
    write: bool = True,
) -> dict[str, Any]:
    """Replay ``run_dir``'s rollouts (see the module docstring); returns the summary and, with
    ``write``, saves it to ``run_dir/reverify.json``.

    Environments: ``task_to_env`` (task -> environment object or Ray actor), else built from
    ``config.yaml``'s ``envs`` section: in this process, or as Ray actors with ``use_ray``
    (Ray must be initialized). Environments built here are shut down afterwards.
    """
    run_dir = Path(run_dir)
    replays = [_Replay.start(record, run_dir) for record in load_rollouts(run_dir)]
    tasks = list(dict.fromkeys(r.record["task"] for r in replays))
    owned: dict[str, Any] = {}
    if task_to_env is None:
        envs_config = load_config(run_dir).get("envs") or {}
        task_to_env = owned = build_task_envs(envs_config, tasks, use_ray=use_ray)
    check_tasks_have_envs(tasks, task_to_env)
    try:
        _replay_all(replays, task_to_env)
    finally:
        shutdown_envs(owned)
    summary = summarize(run_dir, [_comparison(r) for r in replays])
    if write:
        (run_dir / REVERIFY_FILE).write_text(json.dumps(summary, indent=2) + "\n", "utf-8")
    return summary


def build_task_envs(envs_config: dict[str, Any], tasks: list[str], *, use_ray: bool) -> dict:
    """task -> environment for each of ``tasks``, from an ``envs`` config section
    (``{task: {name, config, num_cpus}}``); Ray actors with ``use_ray``."""
    missing = [t for t in tasks if t not in envs_config]
    if missing:
        raise ValueError(
            f"config.yaml's envs section has no environment for task(s) {missing}; "
            f"it names {sorted(envs_config)}. Add them, or pass task_to_env."
        )
    envs: dict[str, Any] = {}
    try:
        for task in tasks:
            envs[task] = _make_env(envs_config[task], use_ray)
    except BaseException:
        shutdown_envs(envs)
        raise
    return envs


def shutdown_envs(envs: dict[str, Any]) -> None:
    """Shut down in-process environments and kill Ray actor environments."""
    for env in envs.values():
        if is_actor(env):
            ray.kill(env)
        else:
            env.shutdown()


def _make_env(spec: dict[str, Any], use_ray: bool) -> Any:
    """One task's environment, as ``envloop run`` makes it (``bundled:`` paths resolved)."""
    name, config = spec["name"], resolve_bundled(spec.get("config"))
    if use_ray:
        if ":" in name and name not in list_envs():
            register_env(name, name)
        return create_env(name, config, num_cpus=spec.get("num_cpus") or 0)
    cls: Any = resolve_env_class(name)
    return cls(config) if config is not None else cls()


def _replay_all(replays: list[_Replay], task_to_env: dict[str, Any]) -> None:
    dispatcher = EnvDispatcher(task_to_env, on_error="record")
    tasks = [r.record["task"] for r in replays]
    try:
        k = 0
        while active := [i for i, r in enumerate(replays) if r.takes_turn(k)]:
            logs: list[Any] = [r.conversation(k) if r.takes_turn(k) else None for r in replays]
            _step(dispatcher, replays, group_by_task(tasks, active), logs)
            k += 1
    finally:
        dispatcher.shutdown()


def _step(dispatcher: EnvDispatcher, replays: list[_Replay], groups: dict, logs: list) -> None:
    """Step ``groups``; a failed group of several samples is retried one sample at a time."""
    metadata = [r.metadata for r in replays]
    for group in dispatcher.step(groups, logs, metadata):
        ret = group.result
        if ret is None and len(group.indices) > 1:
            for i in group.indices:
                _step(dispatcher, replays, {group.task_name: [i]}, logs)
            continue
        for j, i in enumerate(group.indices):
            replay = replays[i]
            if ret is None:
                replay.error = group.error or "environment step failed"
                replay.turn_rewards.append(0.0)
                continue
            parts = ret.rewards if isinstance(ret.rewards, dict) else {"": ret.rewards}
            values = {name: float(value.reshape(-1)[j]) for name, value in parts.items()}
            replay.turn_rewards.append(sum(values.values()))
            for name, value in values.items():
                if name:
                    replay.components[name] = replay.components.get(name, 0.0) + value
            replay.metadata = replay.metadata if ret.metadata[j] is None else ret.metadata[j]
            replay.terminated = bool(ret.terminateds[j])


def _comparison(replay: _Replay) -> dict[str, Any]:
    record = replay.record
    old_turns = [_number(x) for x in record.get("turn_rewards", [record.get("total_reward")])]
    old_error, new_error = record.get("error"), replay.error
    differs = len(old_turns) != len(replay.turn_rewards) or any(
        not (abs(a - b) <= REWARD_TOLERANCE or (math.isnan(a) and math.isnan(b)))
        for a, b in zip(old_turns, replay.turn_rewards)
    )
    status = (
        ("still_error" if new_error else "error_fixed")
        if old_error
        else ("new_error" if new_error else ("changed" if differs else "same"))
    )
    return {
        "sample": record.get("sample"),
        "idx": record.get("idx"),
        "task": record["task"],
        "status": status,
        "old_total_reward": _number(record.get("total_reward", sum(old_turns))),
        "new_total_reward": sum(replay.turn_rewards),
        "old_turn_rewards": old_turns,
        "new_turn_rewards": replay.turn_rewards,
        "old_rewards": record.get("rewards") or {},
        "new_rewards": replay.components,
        "stored_turns": len(replay.assistant_at),
        "replayed_turns": len(replay.turn_rewards),
        "old_error": old_error,
        "new_error": new_error,
    }


def _with_image_paths(content: Any, run_dir: Path) -> Any:
    """A stored content with each image part's file name (relative to the run directory)
    made a path that environments can open from anywhere."""
    if not isinstance(content, list):
        return content
    return [_image_path(part, run_dir.resolve()) for part in content]


def _image_path(part: Any, run_dir: Path) -> Any:
    named = isinstance(part, dict) and part.get("type") == "image"
    if named and isinstance(part.get("image"), str):
        return {**part, "image": str(run_dir / part["image"])}
    return part


def _number(value: Any) -> float:
    """A stored reward as a float; None (how JSON stores NaN) is NaN."""
    return math.nan if value is None else float(value)
