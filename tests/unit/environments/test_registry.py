"""The environment registry: names, import paths, entries, and helpful errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from envloop.config.errors import ConfigError
from envloop.environments.registry import (
    BUILTIN_CONFIG_CHECKS,
    BUILTIN_ENVS,
    ENV_REGISTRY,
    create_env,
    get_config_check,
    get_env_class,
    list_envs,
    register_env,
)
from tests.fixtures.envs import CountdownEnv, EchoEnv, FailingEnv


def test_register_by_class_and_by_path():
    register_env("reg_echo_cls", EchoEnv, overwrite=True)
    register_env("reg_echo_path", "tests.fixtures.envs:EchoEnv", overwrite=True)
    assert get_env_class("reg_echo_cls") is EchoEnv
    assert get_env_class("reg_echo_path") is EchoEnv
    assert {"reg_echo_cls", "reg_echo_path"} <= set(list_envs())


def test_dotted_paths_resolve_like_colon_paths():
    register_env("reg_echo_dotted", "tests.fixtures.envs.EchoEnv", overwrite=True)
    assert get_env_class("reg_echo_dotted") is EchoEnv


def test_entries_hold_the_import_path_and_a_registered_class():
    register_env("reg_entry_cls", EchoEnv, overwrite=True)
    register_env("reg_entry_path", "tests.fixtures.envs.FailingEnv", overwrite=True)
    assert ENV_REGISTRY["reg_entry_cls"] == {
        "actor_class_fqn": "tests.fixtures.envs:EchoEnv",
        "actor_class": EchoEnv,
    }
    assert ENV_REGISTRY["reg_entry_path"] == {"actor_class_fqn": "tests.fixtures.envs.FailingEnv"}


def test_entries_written_straight_into_env_registry_are_used():
    ENV_REGISTRY["reg_direct"] = {"actor_class_fqn": "tests.fixtures.envs.FailingEnv"}
    try:
        assert "reg_direct" in list_envs()
        assert get_env_class("reg_direct") is FailingEnv
    finally:
        del ENV_REGISTRY["reg_direct"]
    assert "reg_direct" not in list_envs()


def test_unknown_name_suggests_a_close_one():
    register_env("reg_sliding", EchoEnv, overwrite=True)
    with pytest.raises(
        ValueError, match=r"No environment named 'reg_slidng'\..*Did you mean 'reg_sliding'\?"
    ):
        get_env_class("reg_slidng")


def test_reregistering_a_name_needs_overwrite():
    register_env("reg_twice", EchoEnv, overwrite=True)
    register_env("reg_twice", EchoEnv)  # same target: fine
    message = (
        "Env name reg_twice already registered as 'tests.fixtures.envs:EchoEnv'; choose "
        "another name, or pass overwrite=True to replace it with 'tests.fixtures.envs:FailingEnv'."
    )
    with pytest.raises(ValueError) as raised:
        register_env("reg_twice", "tests.fixtures.envs:FailingEnv")
    assert str(raised.value) == message
    with pytest.raises(ValueError, match="already registered"):
        register_env("reg_twice", "tests.fixtures.envs:EchoEnv")  # same class, by path
    register_env("reg_twice", FailingEnv, overwrite=True)
    assert get_env_class("reg_twice") is FailingEnv


def test_bad_targets_are_explained():
    for bad in ("EchoEnv", "tests.fixtures.envs:Echo:Env", "tests/fixtures/envs.py:EchoEnv", ""):
        with pytest.raises(ValueError, match="is not an import path; write 'package.module:Class'"):
            register_env("reg_bad", bad)
    with pytest.raises(TypeError, match="target must be a class or an import path string"):
        register_env("reg_bad", EchoEnv())  # an instance, not the class
    assert "reg_bad" not in list_envs()
    register_env("reg_missing_module", "tests.fixtures.nowhere:Env", overwrite=True)
    with pytest.raises(ImportError, match="cannot import module 'tests.fixtures.nowhere'"):
        get_env_class("reg_missing_module")
    register_env("reg_missing_attr", "tests.fixtures.envs:Nope", overwrite=True)
    with pytest.raises(ImportError, match="has no attribute 'Nope'"):
        get_env_class("reg_missing_attr")
    register_env("reg_missing_dotted", "tests.fixtures.envs.Nope", overwrite=True)
    with pytest.raises(ImportError, match="module tests.fixtures.envs has no attribute 'Nope'"):
        get_env_class("reg_missing_dotted")
    register_env("reg_no_package", "nowhere_pkg_xyz.envs.Env", overwrite=True)
    with pytest.raises(ImportError, match="cannot import module 'nowhere_pkg_xyz'"):
        get_env_class("reg_no_package")
    register_env("reg_not_env", "tests.fixtures.batches:make_batch", overwrite=True)
    with pytest.raises(TypeError, match="does not subclass"):
        get_env_class("reg_not_env")


def test_builtins_are_registered_and_resolve():
    from envloop.environments.interfaces import EnvironmentInterface

    assert set(BUILTIN_ENVS) == {
        "math",
        "math_default",
        "math_multi_reward",
        "vlm",
        "reward_model",
        "code",
        "code_jaccard",
        "sliding_puzzle",
        "judge",
    }
    for name, path in BUILTIN_ENVS.items():
        check = BUILTIN_CONFIG_CHECKS[name]
        assert ENV_REGISTRY[name] == {"actor_class_fqn": path, "config_check_fqn": check}
        assert issubclass(get_env_class(name), EnvironmentInterface)
    assert get_env_class("math_default") is get_env_class("math")
    assert get_env_class("code_jaccard").__name__ == "CodeJaccardEnvironment"


BAD_CONFIGS = {
    "math": {"max_attempts": 0, "num_worker": 2},
    "math_default": {"verifier_type": "dapo", "math_verify_impl": "hf_math_verify"},
    "math_multi_reward": {"reward_mode": "multi"},
    "vlm": {"num_workers": 0, "reward_functions": [{"name": "fromat", "weight": 1}]},
    "reward_model": {"batch_size": 0, "resources": {"num_nodes": 2}},
    "code": {"max_turns": 0, "memory_mb": 8},
    "code_jaccard": {"num_workers": 0, "alignment_threshold": -0.5},
    "sliding_puzzle": {"default_size": 1, "reward_on_solve": "1"},
    "judge": {"num_judgements": 0, "mod": "group"},
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_builtin_config_checks_are_what_the_constructors_reject(name):
    check, cls = get_config_check(name), get_env_class(name)
    assert check is not None
    problems = check(BAD_CONFIGS[name])
    assert len(problems) >= 1
    assert cls.config_problems(BAD_CONFIGS[name]) == problems
    with pytest.raises(ConfigError) as raised:
        cls(BAD_CONFIGS[name])
    assert raised.value.problems == problems
    assert check(None) == check({}) == cls.config_problems(None) == []


def test_config_checks_registered_by_path_or_as_a_function():
    def start_below_ten(config):
        return ["start: must be below 10"] if (config or {}).get("start", 0) >= 10 else []

    register_env("reg_checked_fn", CountdownEnv, overwrite=True, config_check=start_below_ten)
    assert get_config_check("reg_checked_fn") is start_below_ten
    assert ENV_REGISTRY["reg_checked_fn"]["config_check_fqn"] == (
        f"{__name__}:test_config_checks_registered_by_path_or_as_a_function.<locals>."
        "start_below_ten"
    )
    path = "tests.fixtures.envs:CountdownEnv.config_problems"
    register_env("reg_checked_path", CountdownEnv, overwrite=True, config_check=path)
    assert get_config_check("reg_checked_path")({"start": 0}) == ["start: must be >= 1, got 0"]
    register_env("reg_unchecked", CountdownEnv, overwrite=True)
    assert get_config_check("reg_unchecked") is None
    with pytest.raises(ValueError, match="No environment named 'reg_uncheckd'"):
        get_config_check("reg_uncheckd")


def test_bad_config_checks_are_explained():
    with pytest.raises(ValueError, match="config_check 'check' is not an import path"):
        register_env("reg_bad_check", EchoEnv, config_check="check")
    with pytest.raises(TypeError, match="config_check must be a function or an import path"):
        register_env("reg_bad_check", EchoEnv, config_check=3)  # type: ignore[arg-type]
    assert "reg_bad_check" not in list_envs()
    register_env("reg_check_missing", EchoEnv, config_check="tests.fixtures.envs:nope")
    with pytest.raises(ImportError, match="Config check of environment 'reg_check_missing'"):
        get_config_check("reg_check_missing")
    with pytest.raises(ValueError) as raised:
        register_env("reg_check_missing", EchoEnv)
    assert str(raised.value) == (
        "Env name reg_check_missing already registered as 'tests.fixtures.envs:EchoEnv' "
        "(config check 'tests.fixtures.envs:nope'); choose another name, or pass "
        "overwrite=True to replace it with 'tests.fixtures.envs:EchoEnv'."
    )


def test_reading_the_registry_imports_no_torch():
    probe = (
        "import sys; from envloop.environments import registry; "
        "problems = registry.get_config_check('reward_model')({'batch_size': 0}); "
        "print(len(problems), 'torch' in sys.modules, "
        "registry.DEFAULT_ACTOR_OPTIONS == {'max_restarts': -1, 'max_task_retries': 3})"
    )
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert child.stdout.split() == ["1", "False", "True"], child.stderr


@pytest.mark.ray
def test_create_env_applies_the_environments_own_actor_options(ray_session):
    register_env("reg_env_var", "tests.fixtures.envs:EnvVarEnv", overwrite=True)
    config = {"name": "ENVLOOP_REGISTRY_TEST", "value": "from actor_options"}
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    own = create_env("reg_env_var", config)
    explicit = create_env("reg_env_var", config, runtime_env={"env_vars": {"OTHER": "1"}})
    try:
        assert ray_session.get(own.step.remote([log], [{}])).observations[0]["content"] == (
            "from actor_options"
        )
        # Options given to create_env win over the environment's own.
        assert ray_session.get(explicit.step.remote([log], [{}])).observations[0]["content"] == (
            "(unset)"
        )
    finally:
        ray_session.kill(own)
        ray_session.kill(explicit)
