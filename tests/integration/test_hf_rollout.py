"""A real multi-turn rollout: the tiny transformer through HfGeneration, a Ray-actor env."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from envloop.environments.registry import create_env, register_env
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig
from tests.fixtures.batches import make_batch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

register_env("test_echo", "tests.fixtures.envs:EchoEnv", overwrite=True)

TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def policy(tiny_policy_dir):
    config = HfGenerationConfig(
        model_name=str(tiny_policy_dir), max_new_tokens=10, temperature=TEMPERATURE, seed=7
    )
    return HfGeneration(config)


def test_end_to_end_rollout_is_token_exact(ray_session, policy, tiny_policy_dir):
    tokenizer = policy.tokenizer
    samples = [
        {"task": "echo", "prompt": p, "metadata": {"reply": r}}
        for p, r in [("What is 2 + 3?", "Try again."), ("Guess a number.", "lower"), ("hi", "ok")]
    ]
    batch = make_batch(tokenizer, samples)
    max_seq_len = max(batch["length"]) + 40
    env = create_env("test_echo", num_cpus=0)
    final, metrics = run_multi_turn_rollout(
        policy, batch, tokenizer, {"echo": env}, max_seq_len, max_rollout_turns=3
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_policy_dir, dtype=torch.float32).eval()
    for i, log in enumerate(final["message_log"]):
        assert [m["role"] for m in log][:3] == ["user", "assistant", "environment"]
        ids = torch.cat([m["token_ids"] for m in log])
        assert len(ids) <= max_seq_len
        if final["truncated"][i]:
            assert len(ids) == max_seq_len
        else:
            assert final["num_turns"][i].item() == 3
        # Every generated token's logprob equals a teacher-forced pass over the whole
        # multi-turn sequence: nothing was re-tokenized between turns.
        with torch.no_grad():
            logits = model(ids[None]).logits[0].float()
        reference = torch.log_softmax(logits[:-1] / TEMPERATURE, dim=-1)
        position = 0
        for message in log:
            n = len(message["token_ids"])
            if message["role"] == "assistant":
                rows = torch.arange(position - 1, position + n - 1)
                expected = reference[rows, message["token_ids"]]
                torch.testing.assert_close(
                    message["generation_logprobs"], expected, atol=1e-4, rtol=0
                )
            position += n
    assert final["total_reward"].tolist() == [0.5 * t for t in final["num_turns"].tolist()]
    assert metrics["total_turns"] == int(final["num_turns"].sum())
    # Seeded sampling: the first sample fills max_seq_len on its last turn, the others don't.
    assert final["num_turns"].tolist() == [3, 3, 3]
    assert final["truncated"].tolist() == [True, False, False]
