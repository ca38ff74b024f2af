"""hf_weights: new weights checked against the served model (every problem in one error)
and prepared before it changes; folders read as from_pretrained reads them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from envloop.models.generation.hf_weights import WeightSpec, stage_weights
from envloop.models.tiny import build_tiny_model
from tests.fixtures.tiny_vlms import SAVERS

VOCAB = 400


@pytest.fixture(scope="module")
def tied_models():
    """Two tiny Qwen3 LMs of one architecture (LM head tied to the embeddings), other seeds."""
    return build_tiny_model(VOCAB, seed=0), build_tiny_model(VOCAB, seed=1)


def fresh(seed: int = 0):
    return build_tiny_model(VOCAB, seed=seed)


def assert_weights_equal(model, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor.to(state[key].dtype)), key


def test_the_spec_lists_keys_shapes_and_tied_groups(tied_models):
    spec = WeightSpec.of(tied_models[0])
    assert spec.tied == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert spec.shapes["lm_head.weight"] == (VOCAB, 64)
    assert list(spec.shapes) == list(tied_models[0].state_dict())


def test_every_problem_is_listed_once_and_the_model_is_unchanged(tied_models):
    model, other = fresh(), tied_models[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = other.state_dict()
    del state["model.norm.weight"]
    state["model.extra.weight"] = torch.zeros(2)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    state["model.layers.1.mlp.up_proj.weight"] = "weights"

    with pytest.raises(ValueError) as info:
        stage_weights(model, state)

    assert str(info.value).splitlines()[:5] == [
        "update_weights: the state dict does not fit the served model, so nothing was "
        "changed (4 problems):",
        "  - model.norm.weight: missing",
        "  - model.extra.weight: unexpected (the model has no such tensor)",
        "  - model.layers.0.mlp.up_proj.weight: shape [3, 3], expected [128, 64]",
        "  - model.layers.1.mlp.up_proj.weight: got str, expected a tensor",
    ]
    assert "or a folder its save_pretrained wrote" in str(info.value)
    assert_weights_equal(model, before)


@pytest.mark.parametrize("given", ["both", "embeddings", "lm_head"])
def test_tied_weights_take_either_key_or_both(tied_models, given):
    model, other = fresh(), tied_models[1]
    state = other.state_dict()
    if given == "embeddings":
        del state["lm_head.weight"]
    elif given == "lm_head":
        del state["model.embed_tokens.weight"]

    stage_weights(model, state).apply()

    assert_weights_equal(model, other.state_dict())
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_tied_keys_with_different_values_or_none_of_them_are_refused(tied_models):
    model, other = fresh(), tied_models[1]
    state = other.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"lm_head\.weight: differs from model\.embed_tokens"):
        stage_weights(model, state)
    del state["lm_head.weight"], state["model.embed_tokens.weight"]
    with pytest.raises(
        ValueError, match=r"model\.embed_tokens\.weight: missing \(tied to lm_head\.weight: give"
    ):
        stage_weights(model, state)


def test_other_dtypes_are_cast_and_a_module_is_read_as_its_state_dict(tied_models):
    model, other = fresh(), tied_models[1]
    stage_weights(model, {k: v.double() for k, v in other.state_dict().items()}).apply()
    assert_weights_equal(model, other.state_dict())
    assert model.lm_head.weight.dtype == torch.float32

    model = fresh()
    stage_weights(model, other).apply()
    assert_weights_equal(model, other.state_dict())
    with pytest.raises(TypeError, match="takes a state dict .* got list"):
        stage_weights(model, [1, 2])


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_a_save_pretrained_folder_loads_sharded_or_not(tied_models, tmp_path, shard):
    model, other = fresh(), tied_models[1]
    other.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    index = (tmp_path / "model.safetensors.index.json").is_file()
    assert index == (shard is not None)

    stage_weights(model, tmp_path).apply()

    assert_weights_equal(model, other.state_dict())


def test_a_folder_with_bad_keys_lists_them_and_one_without_weights_says_so(tied_models, tmp_path):
    model, other = fresh(), tied_models[1]
    other.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    del saved["model.norm.weight"]
    saved["model.extra.weight"] = torch.zeros(2)
    saved["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(saved, tmp_path / "model.safetensors", metadata={"format": "pt"})
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(ValueError) as info:
        stage_weights(model, str(tmp_path))

    assert f"the folder {str(tmp_path)!r} does not fit" in str(info.value)
    assert str(info.value).splitlines()[1:4] == [
        "  - model.norm.weight: missing",
        "  - model.extra.weight: unexpected (the model has no such tensor)",
        "  - model.layers.0.mlp.up_proj.weight: shape [3, 3], expected [128, 64]",
    ]
    assert_weights_equal(model, before)
    with pytest.raises(ValueError, match="holds neither model.safetensors nor"):
        stage_weights(model, tmp_path / "elsewhere")


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SAVERS))
def test_a_vision_language_folder_loads_under_the_modules_keys(family, tmp_path):
    """transformers saves Qwen2.5-VL's ``model.language_model.*`` as ``model.*``: the
    folder still loads, under the served model's keys."""
    from transformers import AutoModelForImageTextToText

    old, new = SAVERS[family](tmp_path / "old", seed=0), SAVERS[family](tmp_path / "new", seed=1)
    served = AutoModelForImageTextToText.from_pretrained(old)
    expected = AutoModelForImageTextToText.from_pretrained(new).state_dict()
    saved = set(load_file(new / "model.safetensors"))
    renamed = family == "qwen2_5_vl"
    assert ("model.language_model.norm.weight" not in saved) == renamed

    stage_weights(served, new).apply()

    assert_weights_equal(served, expected)
    assert not torch.equal(
        served.lm_head.weight, AutoModelForImageTextToText.from_pretrained(old).lm_head.weight
    )
