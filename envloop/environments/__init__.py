"""Environments: the interface, the registry, and the built-in environments."""

from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.registry import create_env, list_envs, register_env

__all__ = ["EnvironmentInterface", "EnvironmentReturn", "create_env", "list_envs", "register_env"]
