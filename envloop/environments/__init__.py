"""Environments: the interface, the registry, the contract checker, and the built-ins.

Names are imported on first use, so a worker process that imports one environment module
(e.g. a math-verify worker) does not pay for torch, Ray and every other environment.
"""

from __future__ import annotations

from envloop.config.import_paths import lazy_attributes

_PUBLIC = {
    "ENV_REGISTRY": "envloop.environments.registry",
    "EnvironmentContractError": "envloop.environments.checker",
    "EnvironmentInterface": "envloop.environments.interfaces",
    "EnvironmentReturn": "envloop.environments.interfaces",
    "SampleEnvironment": "envloop.environments.sample_environment",
    "SampleStep": "envloop.environments.sample_environment",
    "check_env": "envloop.environments.checker",
    "create_env": "envloop.environments.registry",
    "list_envs": "envloop.environments.registry",
    "register_env": "envloop.environments.registry",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC)
