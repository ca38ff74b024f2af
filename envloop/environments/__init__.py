"""Environments: the interface, the registry, and the built-in environments."""

from envloop.environments.check_env import EnvironmentContractError, check_env
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.registry import create_env, list_envs, register_env

__all__ = [
    "EnvironmentContractError",
    "EnvironmentInterface",
    "EnvironmentReturn",
    "check_env",
    "create_env",
    "list_envs",
    "register_env",
]
