"""The run config: YAML + overrides, typed sections, every problem named by its dotted key."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
import typing
from typing import Annotated, Literal

import pytest
from pydantic import Field

from envloop.config.declarations import reference_rows
from envloop.config.errors import ConfigError
from envloop.config.validation import Config
from envloop.environments.registry import register_env
from envloop.run.config import (
    RunConfig,
    apply_overrides,
    config_reference_rows,
    config_reference_table,
    load_run_config,
)

MINIMAL = """\
policy: {model_name: bundled:policy}
data: {path: prompts.jsonl}
envs: {math: {name: math}}
"""


@pytest.fixture
def config_file(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1?", "ground_truth": "2"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(MINIMAL)
    return path


def problems_of(path, overrides=(), text=None):
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path, overrides)
    return info.value.problems


def test_minimal_config_gets_every_default(config_file):
    config = load_run_config(config_file)
    resolved = config.to_dict()
    assert list(resolved) == ["policy", "data", "envs", "rollout", "ray", "output"]
    assert resolved["policy"] == {
        "model_name": "bundled:policy", "tokenizer_name": "bundled:policy",
        "chat_template": "default", "chat_template_kwargs": None, "device": "cpu",
        "dtype": "float32", "temperature": 1.0, "top_p": 1.0, "top_k": None,
        "max_new_tokens": 512, "micro_batch_size": 32, "seed": 0, "num_workers": 1,
        "worker_num_cpus": 1.0, "worker_num_gpus": 0.0, "worker_placement": "default",
        "worker_max_retries": 2, "worker_startup_timeout_s": 600.0, "cpu_threads": 1,
        "kv_cache_on_update": "keep", "backend": "hf",
    }  # fmt: skip
    assert resolved["rollout"] == {
        "observation_format": "raw", "env_step_timeout_s": None, "env_startup_timeout_s": 600.0,
        "on_env_error": "record", "env_max_retries": 1, "max_concurrent_samples": None,
        "coalesce_window_s": 0.002, "max_coalesced_samples": 256, "max_seq_len": 512,
        "max_turns": 4, "generations_per_prompt": 1, "batch_size": 64, "mode": "sync",
        "greedy": False,
    }  # fmt: skip
    assert resolved["data"]["columns"] == {
        "prompt": "prompt", "ground_truth": "ground_truth", "task": "task",
        "system_prompt": None, "metadata": None, "images": None,
    }  # fmt: skip
    assert resolved["envs"] == {
        "math": {"name": "math", "config": None, "num_cpus": None, "stop_strings": None,
                 "requires_ground_truth": None, "placement": "default"},
    }  # fmt: skip
    # The data path is not in the current directory, so it is taken from the config's folder.
    assert config.data.path == str(config_file.parent / "prompts.jsonl")
    assert config.envs["math"].needs_ground_truth()


def test_overrides_are_yaml_scalars_at_dotted_keys(config_file):
    config = load_run_config(
        config_file,
        ["rollout.max_turns=2", "policy.top_k=null", "policy.temperature=0.7", "policy.top_p=1",
         "envs.math.stop_strings=['</a>']", "envs.puzzle.name=sliding_puzzle",
         "rollout.greedy=true", "rollout.env_step_timeout_s=1e-3"],
    )  # fmt: skip
    assert config.rollout.max_turns == 2
    assert config.policy.top_k is None and config.policy.temperature == 0.7
    assert config.policy.top_p == 1.0 and isinstance(config.policy.top_p, float)
    assert config.rollout.env_step_timeout_s == 0.001  # YAML reads 1e-3 as a string
    assert config.envs["math"].stop_strings == ["</a>"]
    assert config.envs["puzzle"].name == "sliding_puzzle"
    assert not config.envs["puzzle"].needs_ground_truth()
    assert config.rollout.greedy is True


def test_apply_overrides_reports_malformed_items():
    problems: list[str] = []
    result = apply_overrides({"rollout": 3}, ["novalue", "rollout.max_turns=2", "a..b=1"], problems)
    assert result == {"rollout": 3}
    assert problems == [
        "override 'novalue': expected dotted.key=value, e.g. rollout.max_turns=4",
        "rollout.max_turns: cannot set it, rollout is 3, not a mapping",
        "override 'a..b=1': expected dotted.key=value, e.g. rollout.max_turns=4",
    ]


def test_every_problem_is_reported_at_once_with_its_dotted_key(config_file):
    environments = ["envs.math.config.num_workrs=2", "envs.math.config.num_workers=two",
                    "envs.puzzle.name=slidng_puzzle", "envs.rm.name=reward_model",
                    "envs.rm.config.resources.num_cpu=1"]  # fmt: skip
    problems = problems_of(
        config_file,
        ["policy.tempreature=2", "rollout.max_turns=four", "rollout.batch_size=0",
         "data.columns.prompt=7", "rollout.mode=asynch", "policy.device=gpu",
         "policy.model_name=bundled:nothing", *environments],
    )  # fmt: skip
    assert problems == [
        "policy.device: 'gpu' is not one of cpu, cuda, auto. Did you mean 'cpu'?",
        "policy.tempreature: unknown option. Did you mean 'temperature'?",
        "data.columns.prompt: expected str, got int (7)",
        "rollout.max_turns: expected int, got str ('four')",
        "rollout.batch_size: must be >= 1, got 0",
        "rollout.mode: 'asynch' is not one of sync, async. Did you mean 'async'?",
        "policy.model_name: No bundled model 'nothing'; the bundled models are policy, "
        "policy_early, reward_model, vlm_policy, judge (write e.g. 'bundled:policy').",
    ]  # environment configs are checked once the rest is valid (a custom one imports torch)
    problems = problems_of(config_file, environments)
    # Other tests register environments too: the list of known names varies.
    problems = [re.sub(r"Known: .*?\. Did", "Known: <registered names>. Did", p) for p in problems]
    assert problems == [
        "envs.math.config.num_workers: expected int, got str ('two')",
        "envs.math.config.num_workrs: unknown option. Did you mean 'num_workers'?",
        "envs.puzzle.name: No environment named 'slidng_puzzle'. Known: <registered names>. "
        "Did you mean 'sliding_puzzle'?",
        "envs.rm.config.resources.num_cpu: unknown option. Did you mean 'num_cpus'?",
    ]


def test_missing_sections_and_files(tmp_path):
    path = tmp_path / "run.yaml"
    problems = problems_of(path, text="policy: {model: m}\nray: 3\n")
    assert problems == [
        "policy.model_name: required",
        "policy.model: unknown option. Did you mean 'model_name'?",  # its earlier name
        "data: required",
        "envs: required",
        "ray: expected a mapping, got int (3)",
    ]
    text = "policy: {model_name: bundled:policy}\ndata: {path: nowhere.jsonl}\nenvs: {}\n"
    problems = problems_of(path, text=text)
    assert problems == [
        "envs: name at least one task, e.g. envs: {math: {name: math}}",
        "data.path: no such file or folder: 'nowhere.jsonl' (relative paths are looked up in "
        "the current directory, then next to the config file). Set data.path to a .jsonl or "
        ".parquet file, a folder saved with save_to_disk, or a hub dataset id (org/name).",
    ]
    assert problems_of(path, text="data: [unclosed\n")[0].startswith(f"{path}: not valid YAML")
    assert problems_of(path, text="- a list\n") == [
        f"{path}: expected a mapping of sections, got ['a list']"
    ]
    assert problems_of(tmp_path / "absent.yaml") == [
        f"{tmp_path / 'absent.yaml'}: no such config file"
    ]


def test_environment_given_by_import_path(config_file):
    config = load_run_config(config_file, ["envs.echo.name=tests.fixtures.envs:EchoEnv"])
    assert config.envs["echo"].name == "tests.fixtures.envs:EchoEnv"
    problems = problems_of(config_file, ["envs.echo.name=tests.fixtures.envs:NoSuchEnv"])
    assert problems == [
        "envs.echo.name: Environment 'tests.fixtures.envs:NoSuchEnv': module tests.fixtures.envs "
        "has no class 'NoSuchEnv'."
    ]


BAD_BUILTIN_CONFIGS = {
    "math": ({"max_attempts": 0}, "max_attempts: must be >= 1, got 0"),
    "math_default": ({"verify_timeout_s": 0}, "verify_timeout_s: must be > 0, got 0"),
    "math_multi_reward": (
        {"verifier_type": "dapo"},
        "verifier_type: math_multi_reward checks <answer> tags with math-verify only; drop "
        "verifier_type and math_verify_impl",
    ),
    "vlm": (
        {"reward_functions": [{"name": "format", "weight": 0}]},
        "reward_functions[0].weight: must be > 0, got 0",
    ),
    "reward_model": (
        {"sequence_packing": {"enabled": True}, "dynamic_batching": {"enabled": True}},
        "sequence_packing.enabled: True conflicts with dynamic_batching.enabled: True; enable "
        "one of them",
    ),
    "code": ({"timeout_s": 0}, "timeout_s: must be > 0, got 0"),
    "code_jaccard": ({"alignment_threshold": 1}, "alignment_threshold: must be < 1, got 1"),
    "sliding_puzzle": ({"move_penalty": -1}, "move_penalty: must be >= 0, got -1"),
}
"""Per built-in environment: a config its constructor rejects for a range or a contradiction
(not a type), and the problem."""


@pytest.mark.parametrize("name", sorted(BAD_BUILTIN_CONFIGS))
def test_builtin_environment_configs_are_checked_beyond_types(config_file, name):
    config, problem = BAD_BUILTIN_CONFIGS[name]
    overrides = [f"envs.t.name={name}", f"envs.t.config={json.dumps(config)}"]
    assert problems_of(config_file, overrides) == [f"envs.t.config.{problem}"]


CHECK_WITHOUT_HEAVY_IMPORTS = """
import sys
from envloop.config.errors import ConfigError
from envloop.run.config import load_run_config
try:
    load_run_config(sys.argv[1])
except ConfigError as exc:
    print(*exc.problems, sep="\\n")
print("heavy:", *[m for m in ("torch", "ray", "transformers", "math_verify", "sympy")
                  if m in sys.modules])
"""


def test_builtin_environment_configs_are_checked_without_heavy_imports(config_file):
    envs = {name: {"name": name, "config": bad} for name, (bad, _) in BAD_BUILTIN_CONFIGS.items()}
    config_file.write_text(
        json.dumps({"policy": {"model_name": "m"}, "data": {"path": "prompts.jsonl"}, "envs": envs})
    )
    child = subprocess.run(
        [sys.executable, "-c", CHECK_WITHOUT_HEAVY_IMPORTS, str(config_file)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    expected = [
        f"envs.{name}.config.{problem}" for name, (_, problem) in BAD_BUILTIN_CONFIGS.items()
    ]
    assert child.stdout.splitlines() == [*expected, "heavy:"]


def test_custom_environment_config_checks_are_reported(config_file):
    countdown = "tests.fixtures.envs:CountdownEnv"
    bad = ["envs.t.config.start=0", "envs.u.name=countdown_test", "envs.u.config.start=two"]
    register_env("countdown_test", countdown, overwrite=True)  # no config check: the class's
    assert problems_of(config_file, [f"envs.t.name={countdown}", *bad]) == [
        "envs.t.config.start: must be >= 1, got 0",
        "envs.u.config.start: expected int, got str ('two')",  # once, though both check types
    ]
    register_env("countdown_test", countdown, overwrite=True, config_check=_start_below_ten)
    assert problems_of(config_file, ["envs.u.name=countdown_test", "envs.u.config.start=10"]) == [
        "envs.u.config.start: must be below 10, got 10"  # only the registered check runs
    ]
    # The registered check stands for the class's, which is not consulted: start 0 passes.
    config = load_run_config(config_file, ["envs.u.name=countdown_test", "envs.u.config.start=0"])
    assert config.envs["u"].config == {"start": 0}


def _start_below_ten(config):
    start = (config or {}).get("start", 3)
    return [f"start: must be below 10, got {start}"] if start >= 10 else []


def test_hub_ids_are_not_checked_as_files(config_file):
    config = load_run_config(config_file, ["data.path=openai/gsm8k"])
    assert config.data.path == "openai/gsm8k"


def test_reference_rows_cover_every_leaf_field():
    rows = list(config_reference_rows())
    keys = [key for key, *_ in rows]
    assert len(keys) == len(set(keys)) == _count_leaves(RunConfig)
    by_key = {key: (type_, default, help_) for key, type_, default, help_ in rows}
    assert by_key["rollout.max_turns"][:2] == ("int", "4")
    assert by_key["policy.top_k"][:2] == ("int or null", "null")
    assert by_key["data.path"][:2] == ("str", "(required)")
    assert by_key["envs.<task>.name"][:2] == ("str", "(required)")
    assert by_key["rollout.mode"][:2] == ("one of sync, async", "sync")
    assert by_key["envs.<task>.stop_strings"][0] == "list of str or null"
    assert all(help_ for _, _, _, help_ in rows)
    table = config_reference_table().splitlines()
    assert table[:2] == ["| key | type | default | description |", "|---|---|---|---|"]
    assert len(table) == len(rows) + 2
    assert all(line.count(" | ") == 3 for line in table[2:])  # pipes in cells are escaped


def _count_leaves(cls) -> int:
    return len(_leaf_keys(cls))


def _leaf_keys(cls) -> set[str]:
    """Every leaf key of a config class; a section with variants (a union of config
    classes, like ``policy``) has the keys of all of them."""
    keys = set()
    for name, f in cls.model_fields.items():
        hint = f.annotation
        inner = typing.get_args(hint)[1] if typing.get_origin(hint) is dict else hint
        variants = (
            [
                typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
                for m in typing.get_args(inner)
            ]
            if typing.get_origin(inner) in (typing.Union, types.UnionType)
            else [inner]
        )
        sections = [v for v in variants if isinstance(v, type) and issubclass(v, Config)]
        if sections:
            keys |= {f"{name}.{key}" for section in sections for key in _leaf_keys(section)}
        else:
            keys.add(name)
    return keys


class Inner(Config):
    size: int = 3
    """N of an N x N board (see ``Board``)."""


class Section(Config):
    inner: Inner = Inner()
    named: Annotated[dict[str, Inner], Field(json_schema_extra={"placeholder": "board"})] = Field(
        default_factory=dict
    )
    kind: Literal["a", "b"] | None = None


def test_reference_rows_of_a_small_section():
    assert list(reference_rows(Section, "x")) == [
        ("x.inner.size", "int", "3", "N of an N x N board (see `Board`)."),
        ("x.named.<board>.size", "int", "3", "N of an N x N board (see `Board`)."),
        ("x.kind", "one of a, b or null", "null", ""),
    ]
