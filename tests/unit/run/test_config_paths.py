"""What counts as a local path, a hub id or a bundled model, and the message for each."""

from __future__ import annotations

import pytest

from envloop.run.config_paths import (
    dataset_problem,
    file_problem,
    is_hub_id,
    is_local_path,
    model_problem,
)

RULES = (
    "hub id (org/name or name: letters, digits, '-', '_' and '.', not starting or ending with "
    "'-' or '.', no '--' or '..')"
)


@pytest.mark.parametrize(
    ("value", "local", "hub"),
    [
        ("/abs/model", True, False),
        ("./model", True, False),
        ("../model", True, False),
        ("~/model", True, False),
        ("a/b/c", True, False),
        ("Qwen/Qwen3-0.6B", False, True),
        ("gpt2", False, True),
        ("org/na..me", False, False),
        ("org--x/name", False, False),
        ("-org/name", False, False),
        ("org/name.", False, False),
        ("my model", False, False),
        ("x" * 97, False, False),
    ],
)
def test_local_paths_and_hub_ids(value, local, hub):
    assert (is_local_path(value), is_hub_id(value)) == (local, hub)


def test_an_existing_relative_folder_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert is_local_path("org/model")
    assert model_problem("policy.model", "org/model") is None


def test_model_problems(tmp_path):
    fix = (
        "Set k to an existing model folder, a hub id or bundled:<name> "
        "(policy, policy_early, reward_model, vlm_policy, judge)."
    )
    assert model_problem("k", str(tmp_path)) is None
    assert model_problem("k", "Qwen/Qwen3-0.6B") is None  # loads later, or says why not
    assert model_problem("k", "bundled:policy") is None
    (tmp_path / "weights.bin").write_text("")
    assert model_problem("k", f"{tmp_path}/weights.bin") == (
        f"k: is a file, not a model folder: '{tmp_path}/weights.bin' (read as a local path; "
        f"hub ids look like org/name, e.g. Qwen/Qwen3-0.6B). {fix}"
    )
    assert model_problem("k", "my model") == (
        f"k: 'my model' is neither an existing folder nor a valid {RULES}. {fix}"
    )
    assert model_problem("k", "bundled:critic") == (
        "k: No bundled model 'critic'; the bundled models are policy, policy_early, "
        "reward_model, vlm_policy, judge (write e.g. 'bundled:policy')."
    )


def test_file_and_dataset_problems(tmp_path):
    assert file_problem("k", str(tmp_path), "state-dict file") == (
        f"k: is a folder, not a file: '{tmp_path}'. Set k to an existing state-dict file, or null."
    )
    (tmp_path / "d.jsonl").write_text("{}\n")
    assert dataset_problem("data.path", str(tmp_path / "d.jsonl"), "auto") is None
    assert dataset_problem("data.path", "org/dataset", "auto") is None  # a hub dataset id
    assert dataset_problem("data.path", "org/dataset", "hf_hub") is None
    assert dataset_problem("data.path", "bad id", "hf_hub") == (
        f"data.path: 'bad id' is not a valid dataset {RULES}."
    )
    assert dataset_problem("data.path", "org/dataset", "jsonl").startswith(
        "data.path: no such file or folder: 'org/dataset' (relative paths are looked up"
    )
