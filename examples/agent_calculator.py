"""A tool-using agent written only against the official ``openai`` SDK, rolled out against
the bundled policy through envloop's agent endpoint, scored, and shown in the HTML report.

The agent (:func:`calculator_agent`) is an ordinary OpenAI-API program: it offers the model
a ``calculate`` tool, runs the calls the model makes and sends their results back, until
the model answers. Nothing in it knows about envloop: ``run_agent_rollouts`` hands it a
``base_url`` of its own session, and the endpoint records what the policy saw and sampled,
token for token (the final batch is ready for a GRPO step: see docs/agents.md). The math
environment scores each conversation's last answer; the agent adds a small reward of its
own for every tool call that evaluated cleanly.

The bundled policy is a tiny model trained to answer arithmetic in ``\\boxed{}``; it was
never taught to call tools, so it mostly answers directly: training on these trajectories
is how it would learn to.

    .venv/bin/python examples/agent_calculator.py [--samples 8] [--out runs/agent_calculator]
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import random
from pathlib import Path
from typing import Any

import openai

CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an integer expression with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOL_BONUS = 0.1
MAX_CALLS = 4
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


async def calculator_agent(base_url: str, datum: dict[str, Any]) -> float:
    """Answer the datum's question, calling ``calculate`` as the model asks; returns
    ``TOOL_BONUS`` per tool call that evaluated."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="envloop")
    messages: list[dict[str, Any]] = [
        {"role": m["role"], "content": m["content"]} for m in datum["prompt_messages"]
    ]
    bonus = 0.0
    async with client:
        for _ in range(MAX_CALLS + 1):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATE], max_tokens=48
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                return bonus
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    expression = json.loads(call.function.arguments)["expression"]
                    result = str(calculate(expression))
                    bonus += TOOL_BONUS
                except (ValueError, KeyError, SyntaxError, json.JSONDecodeError) as error:
                    result = f"error: {error}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return bonus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/agent_calculator")
    args = parser.parse_args()

    from envloop.agents import run_agent_rollouts
    from envloop.data.datasets import PromptSample, build_rollout_batch
    from envloop.demo.tasks import math_items
    from envloop.environments.math_environment import MathEnvironment
    from envloop.models.generation.hf_generation import HfGeneration
    from envloop.report import build_report
    from envloop.run.outputs import write_metrics, write_rollouts
    from envloop.run.records import sample_records

    policy = HfGeneration(
        {"model_name": "bundled:policy", "max_new_tokens": 48, "temperature": 0.7}
    )
    items = random.Random(args.seed).sample(math_items(held_out=True), args.samples)
    samples = [
        PromptSample(i, "math", [{"role": "user", "content": item.question}],
                     item.ground_truth, {"ground_truth": item.ground_truth})
        for i, item in enumerate(items)
    ]  # fmt: skip
    batch = build_rollout_batch(samples, policy.tokenizer)
    final, metrics = asyncio.run(
        run_agent_rollouts(
            calculator_agent,
            batch,
            policy,
            policy.tokenizer,
            {"math": MathEnvironment({"num_workers": 1})},
            max_seq_len=512,
            max_concurrent_agents=8,
            agent_timeout_s=120,
            observation_format="chat_template",
        )
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_rollouts(out, sample_records(final))
    write_metrics(out, metrics)
    report = build_report(out)

    print("First trajectory (one row per segment; sampled turns marked *):")
    for message in final["message_log"][0]:
        mark = "*" if "generation_logprobs" in message else " "
        print(f" {mark} {message['role']:>11}: {str(message['content'])[:90]!r}")
    rewards = final["total_reward"].tolist()
    print(f"\nmean reward {sum(rewards) / len(rewards):.2f} over {len(rewards)} rows; "
          f"agent errors {metrics['agent_error_rate']:.0%}; "
          f"{metrics['total_generated_tokens']} tokens sampled")  # fmt: skip
    print(f"report: {report}")
    policy.shutdown()


if __name__ == "__main__":
    main()
