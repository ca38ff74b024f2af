"""The bundled demo models, loaded with ``from_pretrained`` and run on held-out tasks through
the real rollout engine, with the demo's settings (greedy, 48 new tokens, max_seq_len 512,
observation format ``chat_template``)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.tokenization import tokenize_texts
from envloop.demo import ASSETS, bundled_path, tasks
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.games.sliding_puzzle import SlidingPuzzleEnv, initial_prompt
from envloop.environments.games.sliding_puzzle_board import is_solved
from envloop.environments.math_environment import MathEnvironment
from envloop.environments.reward_model_environment import RewardModelEnvironment
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig

pytestmark = pytest.mark.slow

MAX_SEQ_LEN = 512
QUESTIONS = random.Random(7).sample(tasks.math_items(held_out=True), 24)


@pytest.fixture(scope="module")
def policy():
    config = HfGenerationConfig(
        model_name=str(bundled_path("policy")), max_new_tokens=48, micro_batch_size=32
    )
    return HfGeneration(config)


@pytest.fixture(scope="module")
def math_env():
    env = MathEnvironment({"num_workers": 1})
    yield env
    env.shutdown()


def greedy_rollout(policy, logs, metadata, env, max_turns=1, stop_strings=None):
    """``logs`` as one task against ``env``, with the demo's settings."""
    batch = BatchedDataDict(
        message_log=logs,
        task_name=["task"] * len(logs),
        extra_env_info=metadata,
        stop_strings=[stop_strings] * len(logs),
    )
    final, _ = run_multi_turn_rollout(
        policy, batch, policy.tokenizer, {"task": env}, MAX_SEQ_LEN,
        max_rollout_turns=max_turns, greedy=True, observation_format="chat_template",
    )  # fmt: skip
    return final


def prompt_log(tokenizer, text):
    user = [{"role": "user", "content": text}]
    return get_formatted_message_log(user, tokenizer, add_generation_prompt=True)


def test_bundled_folders_load_and_share_one_chatml_tokenizer():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total < 25 * 2**20
    for name in ("policy", "reward_model"):
        tokenizer = AutoTokenizer.from_pretrained(bundled_path(name))
        assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
        chat = [{"role": "user", "content": "What is 37 + 48?"}]
        assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>user\nWhat is 37 + 48?<|im_end|>\n<|im_start|>assistant\n"
        )
        # One digit per token, so numbers are read and written digit by digit.
        assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]
    policy = AutoModelForCausalLM.from_pretrained(bundled_path("policy"))
    reward = AutoModelForSequenceClassification.from_pretrained(bundled_path("reward_model"))
    assert policy.config.eos_token_id == tokenizer.eos_token_id
    assert (reward.config.num_labels, reward.config.pad_token_id) == (1, tokenizer.pad_token_id)


def test_policy_answers_held_out_arithmetic(policy, math_env):
    tokenizer = policy.tokenizer
    logs = [prompt_log(tokenizer, item.question) for item in QUESTIONS]
    metadata = [{"ground_truth": item.ground_truth} for item in QUESTIONS]
    final = greedy_rollout(policy, logs, metadata, math_env)
    replies = [log[-2]["content"] for log in final["message_log"]]
    assert all(r.endswith("}") and "\\boxed{" in r for r in replies)
    assert [log[-1]["content"] for log in final["message_log"]].count("Environment: correct") > 12
    assert final["total_reward"].mean().item() > 0.5


def test_policy_answers_again_after_incorrect(policy, math_env):
    """Each log holds a wrong first reply (ended with EOS, as generated) and the math
    environment's verdict, tokenized as the engine appends them; the policy tries again."""
    tokenizer, renderer = policy.tokenizer, ObservationRenderer(policy.tokenizer)
    rng = random.Random(0)
    logs = []
    for item in QUESTIONS[:12]:
        wrong = tasks.wrong_response(item, rng)
        verdict_text = renderer.render("environment", "Environment: incorrect", True)
        reply_ids, verdict_ids = tokenize_texts(tokenizer, [wrong, verdict_text])
        reply = {
            "role": "assistant",
            "content": wrong,
            "token_ids": torch.tensor([*reply_ids, tokenizer.eos_token_id]),
        }
        verdict = {
            "role": "environment",
            "content": "Environment: incorrect",
            "token_ids": torch.tensor(verdict_ids),
        }
        logs.append([*prompt_log(tokenizer, item.question), reply, verdict])
    metadata = [{"ground_truth": item.ground_truth} for item in QUESTIONS[:12]]
    final = greedy_rollout(policy, logs, metadata, math_env)
    assert final["total_reward"].mean().item() > 0.5


@pytest.mark.parametrize("stop_strings", [None, ["</action>"]], ids=["eos", "stop_string"])
def test_policy_solves_held_out_sliding_puzzles(policy, stop_strings):
    """With or without the stop string on the first turn, the tokens are the same: the
    policy ends an action with <|im_end|>, which the observation would add otherwise."""
    tokenizer = policy.tokenizer
    episodes = [
        tasks.puzzle_episode(tasks.HELD_OUT_SEED + i, size, shuffle)
        for i, (size, shuffle) in enumerate([(2, 3), (2, 4), (2, 5), (3, 3), (3, 4), (3, 5)])
    ]
    logs = [prompt_log(tokenizer, initial_prompt(e)) for e in episodes]
    final = greedy_rollout(policy, logs, episodes, SlidingPuzzleEnv(), 10, stop_strings)
    solved = [is_solved(md["board"]) for md in final["extra_env_info"]]
    assert any(solved[:3]) and any(solved[3:])
    first = final["message_log"][0][1]
    assert first["content"].startswith("<action>") and first["content"].endswith("</action>")


def test_reward_model_scores_right_replies_above_wrong_ones():
    env = RewardModelEnvironment(
        {"model_name": str(bundled_path("reward_model")), "precision": "float32"}
    )
    rng = random.Random(1)
    logs = []
    for item in QUESTIONS:
        for reply in (item.response(), tasks.wrong_response(item, rng)):
            logs.append(
                [
                    {"role": "user", "content": item.question},
                    {"role": "assistant", "content": reply},
                ]
            )
    rewards = env.step(logs, [None] * len(logs)).rewards.view(-1, 2)
    accuracy = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
    assert accuracy >= 0.8
    assert (rewards[:, 0] > 0).float().mean().item() >= 0.8
    env.shutdown()
