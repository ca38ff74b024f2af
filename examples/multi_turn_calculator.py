"""A multi-turn tool-use rollout: a calculator environment as Ray actors, end to end.

The policy answers arithmetic questions by calling a calculator tool with
``<call>EXPR</call>``; the environment (a Ray actor) replies ``<result>V</result>`` and
hands the policy a new stop string; the policy then answers ``<answer>V</answer>`` and is
rewarded 1 when right. The default policy is scripted (it reads the question and the
tool results from the conversation, like a well-trained model would); ``--model PATH``
runs a real transformers model through ``HfGeneration`` instead.

    .venv/bin/python examples/multi_turn_calculator.py [--samples 8] [--model PATH]
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
import time

import torch

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import init_ray
from envloop.environments import SampleEnvironment, SampleStep, create_env, register_env
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """Integer + - * only; anything else raises ValueError."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"cannot evaluate {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


class CalculatorEnv(SampleEnvironment):
    """``<call>EXPR</call>`` -> ``<result>V</result>``; ``<answer>V</answer>`` ends the episode."""

    def step_sample(self, messages, metadata) -> SampleStep:
        response = messages[-1]["content"]
        if call := re.search(r"<call>(.*?)</call>", response):
            try:
                result = str(calculate(call.group(1)))
            except (ValueError, SyntaxError) as exc:
                result = f"error: {exc}"
            return SampleStep(
                {"role": "tool", "content": f"<result>{result}</result>"},
                reward=0.0,
                metadata={**metadata, "tool_calls": metadata["tool_calls"] + 1},
                next_stop_strings=["</call>", "</answer>"],
            )
        answer = re.search(r"<answer>(.*?)</answer>", response)
        correct = bool(answer) and answer.group(1).strip() == str(metadata["target"])
        return SampleStep("correct" if correct else "incorrect", float(correct), terminated=True)

    def global_post_process_and_metrics(self, batch):
        return batch, {"calculator/accuracy": float(batch["total_reward"].mean())}


def scripted_policy_reply(conversation: str) -> str:
    """Call the tool on the question's two operations one at a time, then answer."""
    question = re.findall(r"What is (.*?)\?", conversation)[-1]
    results = re.findall(r"<result>(.*?)</result>", conversation)
    parts = question.split(" + ")
    if len(results) == 0:
        return f"Let me compute the product first. <call>{parts[0]}</call>"
    if len(results) == 1 and len(parts) > 1:
        return f"Now the sum. <call>{results[0]} + {parts[1]}</call>"
    return f"The result is <answer>{results[-1]}</answer>"


def make_questions(n: int, seed: int) -> list[tuple[str, int]]:
    gen = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randint(2, 30, (n,), generator=gen).tolist() for _ in range(3))
    return [(f"{x} * {y} + {z}", x * y + z) for x, y, z in zip(a, b, c)]


def make_batch(tokenizer, questions) -> BatchedDataDict:
    system = "Use <call>EXPR</call> to compute, then reply <answer>N</answer>."
    logs = [
        get_formatted_message_log(
            [{"role": "system", "content": system}, {"role": "user", "content": f"What is {q}?"}],
            tokenizer,
            add_generation_prompt=True,
        )
        for q, _ in questions
    ]
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"target": target, "tool_calls": 0} for _, target in questions],
        task_name=["calculator"] * len(questions),
        stop_strings=[["</call>", "</answer>"]] * len(questions),
        loss_multiplier=[1.0] * len(questions),
        idx=list(range(len(questions))),
    )


def load_policy(model: str | None):
    if model:
        from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig

        policy = HfGeneration(HfGenerationConfig(model_name=model, max_new_tokens=64))
        return policy, policy.tokenizer
    from envloop.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return ScriptedGeneration(tokenizer, scripted_policy_reply), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="local folder or hub id (default: scripted)")
    args = parser.parse_args()

    init_ray(num_cpus=2, log_to_driver=False)
    register_env("calculator", CalculatorEnv)
    env = create_env("calculator", num_cpus=0)
    policy, tokenizer = load_policy(args.model)
    batch = make_batch(tokenizer, make_questions(args.samples, args.seed))

    start = time.perf_counter()
    final, metrics = run_multi_turn_rollout(
        policy, batch, tokenizer, {"calculator": env}, max_seq_len=512, max_rollout_turns=6,
        observation_format="chat_template",
    )  # fmt: skip
    elapsed = time.perf_counter() - start

    print("\nFirst trajectory:")
    for message in final["message_log"][0]:
        text = message["content"].replace("\n", " ")
        print(f"  [{message['role']:>11}] {len(message['token_ids']):3d} tokens | {text[:90]}")
    print("\n| sample | question | turns | tool calls | reward |\n|---:|---|---:|---:|---:|")
    for i, log in enumerate(final["message_log"]):
        question = re.search(r"What is (.*?)\?", log[1]["content"]).group(1)
        calls = final["extra_env_info"][i]["tool_calls"]
        turns, reward = int(final["num_turns"][i]), float(final["total_reward"][i])
        print(f"| {i} | {question} | {turns} | {calls} | {reward:.1f} |")
    print(f"\nRollout of {len(final['message_log'])} samples in {elapsed:.2f} s")
    for key in ("total_turns", "avg_turns_per_sample", "natural_termination_rate",
                "truncation_rate", "mean_total_tokens_per_sample", "env_error_rate"):  # fmt: skip
        print(f"  {key:32s} {metrics[key]:.3f}")


if __name__ == "__main__":
    main()
