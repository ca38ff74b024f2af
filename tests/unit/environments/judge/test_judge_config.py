"""The judge environment's config: defaults, the judge backend section (hf or server, the
generation backends' own declarations) and every problem reported with its key."""

from __future__ import annotations

import pytest

from envloop.config.errors import ConfigError
from envloop.environments.judge.config import config_problems, validate_config
from envloop.environments.registry import get_config_check


def test_defaults():
    config = validate_config()
    assert config["judge"].backend == "hf"
    assert config["judge"].model_name == "bundled:judge"
    assert (config["template"], config["mode"], config["num_judgements"]) == (
        "reference_equivalence",
        "sample",
        1,
    )
    assert config["verdict"]["kind"] == "yes_no"


def test_judge_section_is_a_backend_config():
    server = validate_config(
        {"judge": {"backend": "server", "base_urls": ["http://h:1"], "tokenizer": "t"}}
    )["judge"]
    assert (server.backend, server.max_retries) == ("server", 5)
    assert config_problems({"judge": {"model_name": "m", "temprature": 1.0}}) == [
        "judge.temprature: unknown option. Did you mean 'temperature'?"
    ]
    assert config_problems({"judge": {"backend": "vllm", "model_name": "m"}}) == [
        "judge.backend: 'vllm' is not a backend; use hf or server"
    ]


def test_every_problem_with_its_key():
    assert sorted(
        config_problems({"num_judgements": 0, "verdict": {"knd": "x"}, "mod": "group"})
    ) == [
        "mod: unknown option. Did you mean 'mode'?",
        "num_judgements: must be >= 1, got 0",
        "verdict.knd: unknown option. Did you mean 'kind'?",
    ]
    assert config_problems(
        {"template": "nope", "verdict": {"kind": "label"}, "num_judgements": 3}
    ) == [
        "template: 'nope' is neither a built-in template (reference_equivalence, rubric, "
        "group_comparison) nor a file",
        "verdict.labels: kind label needs labels, e.g. {A: 1.0, B: 0.0}",
        "num_judgements: 3 greedy judgements are all the same; set greedy: false to sample "
        "them, or num_judgements: 1",
    ]
    with pytest.raises(ConfigError, match="verdict.min: must be below verdict.max"):
        validate_config({"verdict": {"kind": "number", "min": 5, "max": 5}})


def test_registered_check_is_this_one():
    assert get_config_check("judge")({"mode": "pairs"}) == [
        "mode: 'pairs' is not one of sample, group"
    ]
