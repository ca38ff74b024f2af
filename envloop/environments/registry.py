"""Environment registry: names -> environment classes, and Ray actors made from them.

:data:`ENV_REGISTRY` is the registry itself (NeMo-RL's name and entry schema, so code that
reads or edits it directly keeps working): environment name -> :class:`EnvRegistryEntry`.

An entry may also name its **config check**, ``config_check_fqn``: a function
``check(config) -> list[str]`` that returns every problem of an environment config (None
means the defaults), one line each with its key relative to the config
(``"max_attempts: must be >= 1, got 0"``), and that imports only what checking needs.
``envloop run`` calls it to report a bad config before Ray starts, without importing the
environment class (and torch with it). Every built-in names one (its ``*_config`` module's
``config_problems``, which the environment's constructor runs too);
``register_env(..., config_check="mypkg.env_config:config_problems")`` names yours. An entry
without a check is checked by importing the class: its config TypedDict's types, then
``cls.config_problems(config)`` (see
:meth:`~envloop.environments.interfaces.EnvironmentInterface.config_problems`).

Reading the registry imports no torch: the environment classes and the actor machinery
are imported when first used (so is ``DEFAULT_ACTOR_OPTIONS``, still importable from here).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import NotRequired

from envloop.config.import_paths import import_from_path

if TYPE_CHECKING:
    from envloop.environments.interfaces import EnvironmentInterface

__all__ = [
    "BUILTIN_CONFIG_CHECKS",
    "BUILTIN_ENVS",
    "ENV_REGISTRY",
    "ConfigCheck",
    "EnvRegistryEntry",
    "EnvTarget",
    "create_env",
    "get_config_check",
    "get_env_class",
    "list_envs",
    "register_env",
    "unknown_name_message",
]

EnvTarget = str | type["EnvironmentInterface"]
"""An environment class, or its import path: ``"package.module:ClassName"`` or NeMo-RL's
``"package.module.ClassName"``."""

ConfigCheck = Callable[[Any], list[str]]
"""``check(config) -> problems``: every problem of an environment config (None: the
defaults), one line each, keys dotted relative to the config."""


class EnvRegistryEntry(TypedDict):
    """One registered environment."""

    actor_class_fqn: str  # import path of the class, "pkg.mod:Class" or "pkg.mod.Class"
    actor_class: NotRequired[type[EnvironmentInterface]]  # the class, when registered as one
    config_check_fqn: NotRequired[str]  # import path of its ConfigCheck, "pkg.mod:function"
    config_check: NotRequired[ConfigCheck]  # the check, when registered as a function


ENV_REGISTRY: dict[str, EnvRegistryEntry] = {}
"""Environment name -> entry. Registering by path imports nothing until the class is used."""

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")


def register_env(
    name: str,
    target: EnvTarget,
    *,
    overwrite: bool = False,
    config_check: str | ConfigCheck | None = None,
) -> None:
    """Register an environment class (or its import path) under ``name``, optionally with
    its config check: a function or its import path (see the module docstring).

    Registering a name again with the same target and check does nothing; another one
    needs ``overwrite=True``.

    >>> register_env("doc_echo", "envloop.environments.interfaces:EnvironmentInterface")
    >>> ENV_REGISTRY["doc_echo"]
    {'actor_class_fqn': 'envloop.environments.interfaces:EnvironmentInterface'}
    >>> register_env("doc_echo", "mypkg.envs.Echo")
    Traceback (most recent call last):
    ...
    ValueError: Env name doc_echo already registered as \
'envloop.environments.interfaces:EnvironmentInterface'; choose another name, or pass \
overwrite=True to replace it with 'mypkg.envs.Echo'.
    >>> register_env("doc_math", "envloop.environments.math_environment:MathEnvironment",
    ...              config_check="envloop.environments.math.config:config_problems")
    >>> get_config_check("doc_math")({"max_attempts": 0})
    ['max_attempts: must be >= 1, got 0']
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_env: name must be a non-empty string, got {name!r}.")
    entry = _entry_for(name, target)
    _add_config_check(entry, name, config_check)
    existing = ENV_REGISTRY.get(name)
    if existing is not None and existing != entry and not overwrite:
        raise ValueError(
            f"Env name {name} already registered as {_described(existing)}; choose another "
            f"name, or pass overwrite=True to replace it with {_described(entry)}."
        )
    ENV_REGISTRY[name] = entry


def list_envs() -> list[str]:
    """The registered environment names, sorted."""
    return sorted(ENV_REGISTRY)


def get_env_class(name: str) -> type[EnvironmentInterface]:
    """The class registered under ``name`` (importing it if registered by path)."""
    from envloop.environments.interfaces import EnvironmentInterface

    entry = _entry(name)
    cls = entry.get("actor_class")
    if cls is None:
        cls = import_from_path(entry["actor_class_fqn"], f"Environment {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, EnvironmentInterface)):
        raise TypeError(
            f"Environment {name!r} resolves to {cls!r}, which does not subclass "
            "envloop.environments.interfaces.EnvironmentInterface."
        )
    return cls


def get_config_check(name: str) -> ConfigCheck | None:
    """The config check registered with ``name`` (importing only it), or None when the
    entry names none.

    >>> get_config_check("code_jaccard")({"alignment_threshold": 1.5})
    ['alignment_threshold: must be < 1, got 1.5']
    """
    entry = _entry(name)
    check = entry.get("config_check")
    if check is None and "config_check_fqn" in entry:
        what = f"Config check of environment {name!r}"
        check = import_from_path(entry["config_check_fqn"], what, "function", callable)
    return check


def create_env(
    env_name: str, env_config: Any = None, *, placement: str = "default", **ray_options: Any
) -> Any:
    """Start the environment registered as ``env_name`` as a Ray actor and return its handle
    (NeMo-RL's parameter names, so keyword calls port too).

    ``env_config`` goes to the environment's constructor; ``ray_options`` (``num_cpus``,
    ``num_gpus``, ``max_restarts``, ``runtime_env``, ``name``, ...) go to
    ``ActorClass.options``, on top of the environment's own ``actor_options(env_config)``
    (e.g. a reward model's ``resources``) and :data:`DEFAULT_ACTOR_OPTIONS`. ``placement``
    says which nodes of a cluster the actor goes to (``"default"``, ``"spread"`` or
    ``"resource:<name>"``; see :func:`envloop.distributed.ray_utils.placement_options`),
    beneath any ``ray_options``. Ray must be initialized (see
    :func:`envloop.distributed.ray_utils.init_ray`).
    """
    import ray

    from envloop.distributed.ray_utils import placement_options
    from envloop.environments.interfaces import actor_class

    cls = get_env_class(env_name)
    if not ray.is_initialized():
        raise RuntimeError(
            f"create_env({env_name!r}) needs a running Ray session; call "
            "envloop.distributed.ray_utils.init_ray() first."
        )
    placed = placement_options(placement)
    options = {**placed, **cls.actor_options(env_config), **ray_options}
    if "resources" in placed:  # the placement's resource joins the environment's own
        options["resources"] = {**placed["resources"], **(options.get("resources") or {})}
    actor_cls = actor_class(cls, **options)
    return actor_cls.remote(env_config) if env_config is not None else actor_cls.remote()


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


def _add_config_check(entry: EnvRegistryEntry, name: str, check: Any) -> None:
    """Set the entry's config-check keys for ``check``: a function, an import path or None."""
    if check is None:
        return
    if isinstance(check, str):
        if not _PATH.match(check) or ("." not in check and ":" not in check):
            raise ValueError(
                f"register_env({name!r}): config_check {check!r} is not an import path; "
                "write 'package.module:function', e.g. 'mypkg.env_config:config_problems'."
            )
        entry["config_check_fqn"] = check
        return
    if not callable(check):
        raise TypeError(
            f"register_env({name!r}): config_check must be a function or an import path "
            f"string, got {type(check).__name__}."
        )
    qualname = getattr(check, "__qualname__", type(check).__qualname__)
    entry["config_check_fqn"] = f"{check.__module__}:{qualname}"
    entry["config_check"] = check


def _described(entry: EnvRegistryEntry) -> str:
    check = entry.get("config_check_fqn")
    return repr(entry["actor_class_fqn"]) + (f" (config check {check!r})" if check else "")


def _entry(name: str) -> EnvRegistryEntry:
    if name not in ENV_REGISTRY:
        raise ValueError(unknown_name_message("environment", name, list_envs()))
    return ENV_REGISTRY[name]


def __getattr__(name: str) -> Any:
    # DEFAULT_ACTOR_OPTIONS lives with the actor machinery, which imports torch.
    if name == "DEFAULT_ACTOR_OPTIONS":
        from envloop.environments.interfaces import DEFAULT_ACTOR_OPTIONS

        return DEFAULT_ACTOR_OPTIONS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BUILTIN_ENVS: dict[str, str] = {
    "math": "envloop.environments.math_environment:MathEnvironment",
    "math_default": "envloop.environments.math_environment:MathEnvironment",
    "math_multi_reward": "envloop.environments.math_environment:MathMultiRewardEnvironment",
    "vlm": "envloop.environments.vlm_environment:VLMEnvironment",
    "reward_model": "envloop.environments.reward_model_environment:RewardModelEnvironment",
    "code": "envloop.environments.code_environment:CodeEnvironment",
    "code_jaccard": "envloop.environments.code_jaccard_environment:CodeJaccardEnvironment",
    "sliding_puzzle": "envloop.environments.games.sliding_puzzle:SlidingPuzzleEnv",
    "judge": "envloop.environments.judge_environment:JudgeEnvironment",
}
"""The environments envloop ships, registered by import path (imported on first use).
``math_default`` is NeMo-RL's other name for ``math``."""

BUILTIN_CONFIG_CHECKS: dict[str, str] = {
    "math": "envloop.environments.math.config:config_problems",
    "math_default": "envloop.environments.math.config:config_problems",
    "math_multi_reward": "envloop.environments.math.config:multi_reward_config_problems",
    "vlm": "envloop.environments.vlm.config:config_problems",
    "reward_model": "envloop.environments.reward_model.config:config_problems",
    "code": "envloop.environments.code.config:config_problems",
    "code_jaccard": "envloop.environments.code.jaccard_config:config_problems",
    "sliding_puzzle": "envloop.environments.games.sliding_puzzle_config:config_problems",
    "judge": "envloop.environments.judge.config:config_problems",
}
"""The config check of each of :data:`BUILTIN_ENVS`: torch-free functions that the
environments' constructors (and their ``config_problems``) run too."""

for _name, _path in BUILTIN_ENVS.items():
    register_env(_name, _path, config_check=BUILTIN_CONFIG_CHECKS[_name])
