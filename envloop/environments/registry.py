"""Environment registry: names -> environment classes, and Ray actors made from them.

:data:`ENV_REGISTRY` is the registry itself (NeMo-RL's name and entry schema, so code that
reads or edits it directly keeps working): environment name -> :class:`EnvRegistryEntry`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, TypedDict

from typing_extensions import NotRequired

from envloop.environments.interfaces import (
    DEFAULT_ACTOR_OPTIONS,
    EnvironmentInterface,
    actor_class,
)
from envloop.import_paths import import_from_path

__all__ = [
    "BUILTIN_ENVS",
    "DEFAULT_ACTOR_OPTIONS",
    "ENV_REGISTRY",
    "EnvRegistryEntry",
    "EnvTarget",
    "create_env",
    "get_env_class",
    "list_envs",
    "register_env",
    "unknown_name_message",
]

EnvTarget = str | type[EnvironmentInterface]
"""An environment class, or its import path: ``"package.module:ClassName"`` or NeMo-RL's
``"package.module.ClassName"``."""


class EnvRegistryEntry(TypedDict):
    """One registered environment."""

    actor_class_fqn: str  # import path of the class, "pkg.mod:Class" or "pkg.mod.Class"
    actor_class: NotRequired[type[EnvironmentInterface]]  # the class, when registered as one


ENV_REGISTRY: dict[str, EnvRegistryEntry] = {}
"""Environment name -> entry. Registering by path imports nothing until the class is used."""

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")


def register_env(name: str, target: EnvTarget, *, overwrite: bool = False) -> None:
    """Register an environment class (or its import path) under ``name``.

    Registering a name again with the same target does nothing; another target needs
    ``overwrite=True``.

    >>> register_env("doc_echo", "envloop.environments.interfaces:EnvironmentInterface")
    >>> ENV_REGISTRY["doc_echo"]
    {'actor_class_fqn': 'envloop.environments.interfaces:EnvironmentInterface'}
    >>> register_env("doc_echo", "mypkg.envs.Echo")
    Traceback (most recent call last):
    ...
    ValueError: Env name doc_echo already registered as \
'envloop.environments.interfaces:EnvironmentInterface'; choose another name, or pass \
overwrite=True to replace it with 'mypkg.envs.Echo'.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_env: name must be a non-empty string, got {name!r}.")
    entry = _entry_for(name, target)
    existing = ENV_REGISTRY.get(name)
    if existing is not None and existing != entry and not overwrite:
        raise ValueError(
            f"Env name {name} already registered as {existing['actor_class_fqn']!r}; choose "
            f"another name, or pass overwrite=True to replace it with "
            f"{entry['actor_class_fqn']!r}."
        )
    ENV_REGISTRY[name] = entry


def list_envs() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(ENV_REGISTRY)


def get_env_class(name: str) -> type[EnvironmentInterface]:
    """The class registered under ``name`` (importing it if registered by path)."""
    if name not in ENV_REGISTRY:
        raise ValueError(unknown_name_message("environment", name, list_envs()))
    entry = ENV_REGISTRY[name]
    cls = entry.get("actor_class")
    if cls is None:
        cls = import_from_path(entry["actor_class_fqn"], f"Environment {name!r}")
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
    on top of the environment's own ``actor_options(config)`` (e.g. a reward model's
    ``resources``) and :data:`DEFAULT_ACTOR_OPTIONS`. Ray must be initialized (see
    :func:`envloop.distributed.ray_utils.init_ray`).
    """
    import ray

    cls = get_env_class(name)
    if not ray.is_initialized():
        raise RuntimeError(
            f"create_env({name!r}) needs a running Ray session; call "
            "envloop.distributed.ray_utils.init_ray() first."
        )
    actor_cls = actor_class(cls, **{**cls.actor_options(config), **ray_options})
    return actor_cls.remote(config) if config is not None else actor_cls.remote()


def unknown_name_message(kind: str, name: str, known: list[str]) -> str:
    """``"No <kind> 'mth'. Known: math, code. Did you mean 'math'?"``."""
    message = f"No {kind} named {name!r}. Known: {', '.join(known) or '(none registered)'}."
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        message += f" Did you mean {close[0]!r}?"
    return message


def _entry_for(name: str, target: Any) -> EnvRegistryEntry:
    """The registry entry for ``target``, a class or an import path (checked for form only,
    so registering imports nothing)."""
    if isinstance(target, type):
        return {
            "actor_class_fqn": f"{target.__module__}:{target.__qualname__}",
            "actor_class": target,
        }
    if not isinstance(target, str):
        raise TypeError(
            f"register_env({name!r}): target must be a class or an import path string, "
            f"got {type(target).__name__}."
        )
    if not _PATH.match(target) or ("." not in target and ":" not in target):
        raise ValueError(
            f"register_env({name!r}): {target!r} is not an import path; write "
            "'package.module:Class' or 'package.module.Class', e.g. 'mypkg.envs:MyEnv'."
        )
    return {"actor_class_fqn": target}


BUILTIN_ENVS: dict[str, str] = {
    "math": "envloop.environments.math_environment:MathEnvironment",
    "math_default": "envloop.environments.math_environment:MathEnvironment",
    "math_multi_reward": "envloop.environments.math_environment:MathMultiRewardEnvironment",
    "vlm": "envloop.environments.vlm_environment:VLMEnvironment",
    "reward_model": "envloop.environments.reward_model_environment:RewardModelEnvironment",
    "code": "envloop.environments.code_environment:CodeEnvironment",
    "code_jaccard": "envloop.environments.code_jaccard_environment:CodeJaccardEnvironment",
    "sliding_puzzle": "envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv",
}
"""The environments envloop ships, registered by import path (imported on first use).
``math_default`` is NeMo-RL's other name for ``math``."""

for _name, _path in BUILTIN_ENVS.items():
    register_env(_name, _path)
