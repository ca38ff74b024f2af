"""Environment registry: names -> environment classes, and Ray actors made from them."""

from __future__ import annotations

import difflib
from typing import Any

from envloop.environments.interfaces import EnvironmentInterface
from envloop.import_paths import import_from_path

EnvTarget = str | type[EnvironmentInterface]
"""An environment class, or its import path as ``"package.module:ClassName"``."""

_REGISTRY: dict[str, EnvTarget] = {}

DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"max_restarts": 3, "max_task_retries": 3}
"""Ray options every environment actor gets unless overridden: a dead actor is restarted
and its in-flight ``step`` retried (environments keep episode state in metadata, so a
retried step gives the same answer)."""


def register_env(name: str, target: EnvTarget, *, overwrite: bool = False) -> None:
    """Register an environment class (or ``"module:Class"`` path) under ``name``.

    >>> register_env("doc_echo", "envloop.environments.interfaces:EnvironmentInterface")
    >>> "doc_echo" in list_envs()
    True
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_env: name must be a non-empty string, got {name!r}.")
    if not isinstance(target, str) and not isinstance(target, type):
        raise TypeError(
            f"register_env({name!r}): target must be a class or a 'module:Class' string, "
            f"got {type(target).__name__}."
        )
    if isinstance(target, str) and ":" not in target:
        raise ValueError(
            f"register_env({name!r}): import path {target!r} needs the form 'module:Class', "
            "e.g. 'mypkg.envs:MyEnv'."
        )
    existing = _REGISTRY.get(name)
    if existing is not None and existing != target and not overwrite:
        raise ValueError(
            f"Environment {name!r} is already registered as {_describe(existing)}; "
            "pass overwrite=True to replace it, or choose another name."
        )
    _REGISTRY[name] = target


def list_envs() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(_REGISTRY)


def get_env_class(name: str) -> type[EnvironmentInterface]:
    """The class registered under ``name`` (importing it if registered by path)."""
    if name not in _REGISTRY:
        raise ValueError(unknown_name_message("environment", name, list_envs()))
    target = _REGISTRY[name]
    cls = import_from_path(target, f"Environment {name!r}") if isinstance(target, str) else target
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(
            f"Environment {name!r} resolves to {cls!r}, which does not subclass "
            "envloop.environments.interfaces.EnvironmentInterface."
        )
    return cls


def create_env(name: str, config: Any = None, **ray_options: Any) -> Any:
    """Start environment ``name`` as a Ray actor and return its handle.

    ``config`` goes to the environment's constructor; ``ray_options`` (``num_cpus``,
    ``num_gpus``, ``max_restarts``, ``runtime_env``, ...) go to ``ActorClass.options``,
    on top of :data:`DEFAULT_ACTOR_OPTIONS`. Ray must be initialized (see
    :func:`envloop.distributed.ray_utils.init_ray`).
    """
    import ray

    cls = get_env_class(name)
    if not ray.is_initialized():
        raise RuntimeError(
            f"create_env({name!r}) needs a running Ray session; call "
            "envloop.distributed.ray_utils.init_ray() first."
        )
    options = {**DEFAULT_ACTOR_OPTIONS, **ray_options}
    actor_cls = ray.remote(cls).options(**options)
    return actor_cls.remote(config) if config is not None else actor_cls.remote()


def unknown_name_message(kind: str, name: str, known: list[str]) -> str:
    """``"No <kind> 'mth'. Known: math, code. Did you mean 'math'?"``."""
    message = f"No {kind} named {name!r}. Known: {', '.join(known) or '(none registered)'}."
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        message += f" Did you mean {close[0]!r}?"
    return message


def _describe(target: EnvTarget) -> str:
    return target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"


BUILTIN_ENVS: dict[str, str] = {
    "math": "envloop.environments.math_environment:MathEnvironment",
    "vlm": "envloop.environments.vlm_environment:VLMEnvironment",
    "reward_model": "envloop.environments.reward_model_environment:RewardModelEnvironment",
    "code": "envloop.environments.code_environment:CodeEnvironment",
    "sliding_puzzle": "envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv",
}
"""The environments envloop ships, registered by import path (imported on first use)."""

for _name, _path in BUILTIN_ENVS.items():
    register_env(_name, _path)
