"""run_agent_rollouts: 64 agents written against the openai SDK through one endpoint over
real HTTP, one hanging and one raising, scored by an environment into the engines' final
batch (consumed by the GRPO blocks unchanged)."""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
import torch

from envloop.agents import run_agent_rollouts, segment_advantages
from envloop.algorithms.grpo import training_batch
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch

N = 64
HANGS, RAISES, REWRITES, SILENT = 5, 7, 9, 11
AGENT_REWARD = 0.25
TIMEOUT_S = 15.0  # the hanging agent costs this much; the others finish well before
ADD = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {}}},
}


class AnswerEnv(EnvironmentInterface):
    """Reward 1 when the conversation's last message holds ``metadata["answer"]``."""

    def step(self, message_log_batch, metadata, *args, **kwargs) -> EnvironmentReturn:
        rewards = [float(str(md["answer"]) in log[-1]["content"]) for log, md in
                   zip(message_log_batch, metadata)]  # fmt: skip
        return EnvironmentReturn(
            [{"role": "environment", "content": "correct" if r else "wrong"} for r in rewards],
            [{**md, "turns_seen": len(log)} for log, md in zip(message_log_batch, metadata)],
            [None] * len(rewards),
            torch.tensor(rewards),
            torch.ones(len(rewards), dtype=torch.bool),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


def respond(prompt: str) -> str:
    """The policy: calls ``add`` on the question's numbers, then states the tool's result."""
    result = re.findall(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", prompt)
    if result:
        return f"The answer is {result[-1]}."
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", prompt)[-1])
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


_HTTP: list[openai.DefaultAsyncHttpxClient] = []


def shared_http_client() -> openai.DefaultAsyncHttpxClient:
    """One HTTP client for every agent (building one costs ~0.2 s of CPU: its TLS context)."""
    if not _HTTP:
        _HTTP.append(openai.DefaultAsyncHttpxClient())
    return _HTTP[0]


async def agent(base_url: str, datum: dict) -> float | None:
    """A tool-using agent on the official SDK; some samples misbehave on purpose."""
    index = datum["idx"]
    if index == RAISES:
        raise RuntimeError("agent bug")
    if index == SILENT:
        return None
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, http_client=shared_http_client()
    )
    messages = [{"role": m["role"], "content": m["content"]} for m in datum["message_log"]]
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
        message = reply.choices[0].message
        if not message.tool_calls:
            return AGENT_REWARD
        if index == HANGS:
            await asyncio.sleep(3600)
        [call] = message.tool_calls
        total = sum(json.loads(call.function.arguments).values())
        if index == REWRITES:  # compacts its context: the call is summarized away
            messages = [*messages, {"role": "user", "content": "(add was called)"}]
        else:
            messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(total)})


@pytest.fixture(scope="module")
def rollout(tiny_tokenizer):
    tok = tiny_tokenizer
    samples = [
        {
            "task": "add",
            "system": "Use the add tool.",
            "prompt": f"What is {i} + {i + 1}?",
            "metadata": {"answer": 2 * i + 1},
        }
        for i in range(N)
    ]
    batch = make_batch(tok, samples)
    policy = ScriptedGeneration(tok, respond)
    final, metrics = run_agent_rollouts(
        agent, batch, policy, tok, {"add": AnswerEnv()}, max_seq_len=256,
        max_concurrent_agents=N, agent_timeout_s=TIMEOUT_S, observation_format="chat_template",
    )  # fmt: skip
    return batch, final, metrics


def rows_of(final, sample: int) -> list[int]:
    return [r for r, i in enumerate(final["agent_sample_index"].tolist()) if i == sample]


def test_every_well_behaved_agent_finishes_with_an_exact_scored_trajectory(rollout, tiny_tokenizer):
    tok = tiny_tokenizer
    batch, final, _ = rollout
    for sample in set(range(N)) - {HANGS, RAISES, REWRITES, SILENT}:
        [r] = rows_of(final, sample)
        log = final["message_log"][r]
        call = respond(f"What is {sample} + {sample + 1}?")
        answer = f"The answer is {2 * sample + 1}."
        prompt = torch.cat([m["token_ids"] for m in batch["message_log"][sample]]).tolist()
        tool_turn = tok.encode(f"\n<|im_start|>tool\n{2 * sample + 1}<|im_end|>\n")
        expected = [
            *prompt, *tok.encode(call), tok.eos_token_id, *tool_turn,
            *tok.encode("<|im_start|>assistant\n"), *tok.encode(answer), tok.eos_token_id,
            *tok.encode("\n<|im_start|>environment\ncorrect<|im_end|>\n<|im_start|>assistant\n"),
        ]  # fmt: skip
        assert torch.cat([m["token_ids"] for m in log]).tolist() == expected
        assert [m["role"] for m in log] == [
            "system", "user", "assistant", "tool", "assistant", "environment"
        ]  # fmt: skip
        assert [m["content"] for m in log if "generation_logprobs" in m] == [call, answer]
        assert final["total_reward"][r] == 1.0 + AGENT_REWARD
        assert final["turn_rewards"][r] == [1.0 + AGENT_REWARD]
        assert final["agent_reward"][r] == AGENT_REWARD
        assert (final["num_turns"][r], final["loss_multiplier"][r]) == (2, 1.0)
        assert bool(final["terminated"][r]) and final["env_error"][r] is None
        assert final["extra_env_info"][r] == {"answer": 2 * sample + 1, "turns_seen": 5}


def test_a_hanging_and_a_raising_agent_fail_only_their_own_samples(rollout):
    _, final, metrics = rollout
    [hang] = rows_of(final, HANGS)
    assert final["env_error"][hang] == f"agent did not finish within agent_timeout_s={TIMEOUT_S} s"
    assert final["loss_multiplier"][hang] == 0.0
    assert final["num_turns"][hang] == 1  # what it did before it hung is kept
    [bug] = rows_of(final, RAISES)
    assert final["env_error"][bug] == "agent raised RuntimeError: agent bug"
    assert final["agent_segment_reason"][bug] == "no request"
    [silent] = rows_of(final, SILENT)
    assert (final["env_error"][silent], final["loss_multiplier"][silent]) == (None, 1.0)
    assert metrics["agent_error_rate"] == 2 / N
    assert metrics["agent_timeout_rate"] == 1 / N
    assert metrics["env_error_rate"] == pytest.approx(2 / len(final["message_log"]))


def test_a_rewritten_history_is_one_row_per_segment_with_the_sample_s_reward(rollout):
    _, final, metrics = rollout
    start, rewrite = rows_of(final, REWRITES)
    assert final["agent_segment"][[start, rewrite]].tolist() == [0, 1]
    assert final["agent_segment_reason"][start] == "start"
    assert final["agent_segment_reason"][rewrite].startswith("rewrite: messages[2] (user)")
    assert final["total_reward"][[start, rewrite]].tolist() == [1.0 + AGENT_REWARD] * 2
    roles = [(m["role"], "generation_logprobs" in m) for m in final["message_log"][rewrite]]
    assert roles == [
        ("system", False), ("user", False), ("user", False), ("tool", False),
        ("assistant", True), ("environment", False),
    ]  # fmt: skip
    assert len(final["message_log"]) == N + 1
    assert metrics["segments_per_sample"] == (N - 4 + 2 + 1) / N  # 2 agents made no request
    assert metrics["rewrite_rate"] == 1 / N


def test_the_grpo_blocks_train_on_exactly_the_sampled_tokens(rollout, tiny_tokenizer):
    _, final, _ = rollout
    advantages = segment_advantages(final, group_size=4)
    start, rewrite = rows_of(final, REWRITES)
    assert advantages[start] == advantages[rewrite]
    train = training_batch(final, advantages, tiny_tokenizer.pad_token_id)
    for r, log in enumerate(final["message_log"]):
        sampled = sum(len(m["token_ids"]) for m in log if "generation_logprobs" in m)
        trainable = int(train["token_loss_mask"][r].sum())
        assert trainable == (sampled if final["loss_multiplier"][r] else 0)
