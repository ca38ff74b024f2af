from __future__ import annotations

import math

import openai
import pytest
import torch

from envloop.agents import AgentEndpoint, run_agent_rollouts
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch


class HalfEnv(EnvironmentInterface):
    """Reward 0.5 for every conversation, which it ends."""

    def step(self, message_log_batch, metadata, *args, **kwargs) -> EnvironmentReturn:
        n = len(message_log_batch)
        return EnvironmentReturn(
            [{"role": "environment", "content": "ok"}] * n, [None] * n, [None] * n,
            torch.full((n,), 0.5), torch.ones(n, dtype=torch.bool),
        )  # fmt: skip

    def global_post_process_and_metrics(self, batch):
        return batch, {}


RETURNS = {0: 1.5, 1: "great", 2: math.nan, 3: None}


async def agent(base_url, datum):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": m["role"], "content": m["content"]} for m in datum["message_log"]]
    async with client:
        await client.chat.completions.create(model="m", messages=messages)
    if datum["idx"] == 4:
        raise TimeoutError("the agent's own deadline passed")
    return RETURNS[datum["idx"]]


def test_what_an_agent_returns_or_raises_becomes_its_sample_s_outcome(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [{"task": "t", "prompt": f"q{i}"} for i in range(5)])
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "a")
    final, metrics = run_agent_rollouts(
        agent, batch, policy, tiny_tokenizer, {"t": HalfEnv()}, max_seq_len=64
    )
    assert final["total_reward"].tolist() == [2.0, 0.0, 0.0, 0.5, 0.0]
    assert final["agent_reward"].tolist() == [1.5, 0.0, 0.0, 0.0, 0.0]
    assert final["env_error"] == [
        None,
        "agent returned str 'great'; an agent returns a float reward (added to the "
        "environment's) or None",
        "agent returned the reward nan; rewards must be finite",
        None,
        "agent raised TimeoutError: the agent's own deadline passed",
    ]
    assert final["loss_multiplier"] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert (metrics["agent_error_rate"], metrics["agent_timeout_rate"]) == (0.6, 0.0)


def test_an_endpoint_must_not_serve_longer_conversations_than_the_rollout(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [{"task": "t", "prompt": "q"}])
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "a")
    endpoint = AgentEndpoint(policy, tiny_tokenizer, max_seq_len=128)
    with pytest.raises(ValueError, match="max_seq_len=128, more than this rollout's"):
        run_agent_rollouts(
            agent, batch, policy, tiny_tokenizer, {"t": HalfEnv()}, max_seq_len=64,
            endpoint=endpoint,
        )  # fmt: skip
    with pytest.raises(ValueError, match="No environment for task named 't'. Known: u."):
        run_agent_rollouts(agent, batch, policy, tiny_tokenizer, {"u": HalfEnv()}, max_seq_len=64)
