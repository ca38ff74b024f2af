"""``bundled:<name>`` resolves in the library's loaders, not only on the command line."""

from __future__ import annotations

import pytest

from envloop.environments.reward_model.loading import load_reward_model
from envloop.models.bundled import bundled_path, resolve_bundled, resolve_model
from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig


def test_resolve_model_maps_bundled_names_and_keeps_other_paths():
    assert resolve_model("bundled:policy") == str(bundled_path("policy"))
    assert resolve_model("org/name") == "org/name"
    assert resolve_bundled({"a": ["bundled:reward_model", 3]}) == {
        "a": [str(bundled_path("reward_model")), 3]
    }
    with pytest.raises(ValueError, match="^No bundled model 'critic'; the bundled models are "):
        resolve_model("bundled:critic")


def test_hf_generation_loads_bundled_policy_and_keeps_the_name():
    policy = HfGeneration(HfGenerationConfig(model_name="bundled:policy"))
    assert policy.config.model_name == policy.config.tokenizer_name == "bundled:policy"
    assert policy.tokenizer.name_or_path == str(bundled_path("policy"))
    assert policy.model.name_or_path == str(bundled_path("policy"))


def test_reward_model_loader_takes_bundled_names():
    config = {"model_name": "bundled:reward_model", "tokenizer": {"name": "bundled:policy"},
              "precision": "float32", "checkpoint_path": None}  # fmt: skip
    tokenizer, model = load_reward_model(config, "cpu")
    assert tokenizer.name_or_path == str(bundled_path("policy"))
    assert model.name_or_path == str(bundled_path("reward_model"))
