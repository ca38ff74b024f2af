"""examples/grpo_train.py: three GRPO steps, sync and async, with the real bundled early
checkpoint generating through ``HfGeneration`` and ``MathEnvironment`` as a Ray actor."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import REPO_ROOT


def load_example():
    path = REPO_ROOT / "examples" / "grpo_train.py"
    spec = importlib.util.spec_from_file_location("grpo_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["grpo_train"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


grpo_train = load_example()


def test_every_option_is_a_flag_with_the_config_default():
    assert grpo_train.parse_config([]) == grpo_train.GrpoConfig()
    config = grpo_train.parse_config(
        ["--mode", "async", "--group-size", "4", "--temperature", "0.7", "--out", "x"]
    )
    assert (config.mode, config.group_size, config.temperature, config.out) == (
        "async", 4, 0.7, "x",
    )  # fmt: skip
    with pytest.raises(SystemExit):
        grpo_train.parse_config(["--mode", "asynch"])


def trained_token_ids(log: list[dict]) -> list[int]:
    """The tokens a row's loss may cover: its assistant messages', nothing else."""
    return [t for m in log if m["role"] == "assistant" for t in m["token_ids"].tolist()]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_three_steps_update_the_policy_from_its_own_rollouts(ray_session, mode):
    config = grpo_train.GrpoConfig(
        mode=mode, steps=3, group_size=4, prompts_per_step=2, max_new_tokens=40,
        max_attempts=2, eval_prompts=0, lr=1e-3,
    )  # fmt: skip
    start = AutoModelForCausalLM.from_pretrained(config.policy).state_dict()
    result = grpo_train.train(config, log=lambda line: None)

    records, policy, trainer = result.records, result.policy, result.trainer
    assert [r["step"] for r in records] == [1, 2, 3]
    assert policy.policy_version == 3
    if mode == "sync":  # each step's experience comes from the weights of the step before
        assert [(r["min_policy_version"], r["max_policy_version"]) for r in records] == [
            (0, 0), (1, 1), (2, 2),
        ]  # fmt: skip
    else:  # at most one version behind when it was handed over
        assert all(0 <= r["staleness"] <= 1 for r in records)
        assert all(r["max_policy_version"] <= r["step"] - 1 for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert any(r["grad_norm"] > 0 for r in records)  # some group's rewards differed

    trained = trainer.model.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    served = policy.model.state_dict()
    assert all(torch.equal(served[k], trained[k]) for k in served)

    rollouts, batch = trainer.last_rollouts, trainer.last_batch
    mask = batch["token_loss_mask"].bool()
    roles = [{m["role"] for m in log} for log in rollouts["message_log"]]
    assert any("environment" in r for r in roles)  # a retry after "Environment: incorrect"
    for row, log in enumerate(rollouts["message_log"]):
        assert batch["input_ids"][row][mask[row]].tolist() == trained_token_ids(log)
    assert int(mask.sum()) == records[-1]["trainable_tokens"]
