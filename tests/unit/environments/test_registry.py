"""The environment registry: names, import paths, and helpful errors."""

from __future__ import annotations

import pytest

from envloop.environments.registry import get_env_class, list_envs, register_env
from tests.fixtures.envs import EchoEnv


def test_register_by_class_and_by_path():
    register_env("reg_echo_cls", EchoEnv, overwrite=True)
    register_env("reg_echo_path", "tests.fixtures.envs:EchoEnv", overwrite=True)
    assert get_env_class("reg_echo_cls") is EchoEnv
    assert get_env_class("reg_echo_path") is EchoEnv
    assert {"reg_echo_cls", "reg_echo_path"} <= set(list_envs())


def test_unknown_name_suggests_a_close_one():
    register_env("reg_sliding", EchoEnv, overwrite=True)
    with pytest.raises(
        ValueError, match=r"No environment named 'reg_slidng'\..*Did you mean 'reg_sliding'\?"
    ):
        get_env_class("reg_slidng")


def test_reregistering_a_name_needs_overwrite():
    register_env("reg_twice", EchoEnv, overwrite=True)
    register_env("reg_twice", EchoEnv)  # same target: fine
    with pytest.raises(ValueError, match="already registered.*overwrite=True"):
        register_env("reg_twice", "tests.fixtures.envs:FailingEnv")


def test_bad_targets_are_explained():
    with pytest.raises(ValueError, match="needs the form 'module:Class'"):
        register_env("reg_bad", "tests.fixtures.envs.EchoEnv")
    register_env("reg_missing_module", "tests.fixtures.nowhere:Env", overwrite=True)
    with pytest.raises(ImportError, match="cannot import module 'tests.fixtures.nowhere'"):
        get_env_class("reg_missing_module")
    register_env("reg_missing_attr", "tests.fixtures.envs:Nope", overwrite=True)
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        get_env_class("reg_missing_attr")
    register_env("reg_not_env", "tests.fixtures.batches:make_batch", overwrite=True)
    with pytest.raises(TypeError, match="does not subclass"):
        get_env_class("reg_not_env")


def test_builtins_are_registered_and_resolve():
    from envloop.environments.interfaces import EnvironmentInterface
    from envloop.environments.registry import BUILTIN_ENVS

    assert set(BUILTIN_ENVS) == {"math", "vlm", "reward_model", "code", "sliding_puzzle"}
    for name in BUILTIN_ENVS:
        assert name in list_envs()
        assert issubclass(get_env_class(name), EnvironmentInterface)
