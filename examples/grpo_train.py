"""GRPO on envloop's experience: a tiny policy gets better at arithmetic from rewards alone.

    .venv/bin/python examples/grpo_train.py [--mode sync|async] [--steps 60] [--seed 0]
        [--group-size 8] [--prompts-per-step 16] [--temperature 1.0] [--out DIR] ...

Each step, envloop generates ``group_size`` answers to each of ``prompts_per_step`` training
questions (``What is 37 + 48?``, scored 1 or 0 by ``MathEnvironment`` running as a Ray
actor); the trainer turns the rewards into group-relative advantages (``group_advantages``),
recomputes the log-probabilities of the generated tokens with its own fp32 copy of the
model (teacher forcing), takes one AdamW step on the clipped policy-gradient loss
(``clipped_pg_loss``, the sampler's logprobs as the old policy), and hands its weights to
the generation backend (``update_weights(state_dict, version=step)``).

- ``--mode sync``: one ``run_multi_turn_rollout`` per step, always on-policy.
- ``--mode async``: an ``ExperienceStream`` (``max_staleness=1``) keeps generating while the
  trainer trains on the groups it already has; a step's groups may be one version old.

Held-out reward (questions never trained on, one sample each at the training temperature)
is measured before the first step and after the last. The default policy is an early
checkpoint of the bundled policy's own training run (``scripts/train_demo_policy.py
--save-at 1000 DIR``), weak but not hopeless at temperature 1: see docs/grpo_training.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import ray
import torch
from pydantic import Field
from transformers import AutoModelForCausalLM

from envloop.algorithms.grpo import group_advantages, training_batch
from envloop.algorithms.loss import clipped_pg_loss
from envloop.config.validation import Config, NonEmptyStr
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.demo import ASSETS, tasks
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import init_ray
from envloop.environments.math_environment import MathEnvironment
from envloop.experience.rollouts import ExperienceStream, run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration

MAX_SEQ_LEN = 512
TASK = "math"
EARLY_POLICY = ASSETS / "policy_early"
"""Step 1000 of the bundled policy's 1800-step training run (see the module docstring)."""


class GrpoConfig(Config, title="grpo_train.py options"):
    """The example's options; each is also a command-line flag (``group_size``:
    ``--group-size``)."""

    mode: Literal["sync", "async"] = "sync"
    """sync: one run_multi_turn_rollout per step; async: an ExperienceStream, max_staleness 1."""
    policy: NonEmptyStr = str(EARLY_POLICY)
    """The starting policy: a from_pretrained folder."""
    steps: Annotated[int, Field(ge=1)] = 60
    """Training steps (one AdamW step and one weight update each)."""
    seed: Annotated[int, Field(ge=0)] = 0
    """Seeds the order of training questions, the sampler and the trainer."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """Answers per question; advantages are relative to the question's group."""
    prompts_per_step: Annotated[int, Field(ge=1)] = 16
    """Questions per step (a step trains on group_size x prompts_per_step answers)."""
    temperature: Annotated[float, Field(gt=0)] = 1.0
    """Sampling temperature; the trainer's logprobs use it too, and so does the evaluation."""
    lr: Annotated[float, Field(gt=0)] = 5e-4
    """AdamW learning rate (constant)."""
    clip: Annotated[float, Field(gt=0)] = 0.2
    """PPO clip range on both sides of the trainer/sampler probability ratio."""
    max_new_tokens: Annotated[int, Field(ge=1)] = 48
    """Most tokens per answer (a worked two-digit answer takes about 30)."""
    max_attempts: Annotated[int, Field(ge=1)] = 1
    """Answers per question and episode (MathEnvironment's max_attempts): more than 1 also
    trains the retry after "Environment: incorrect"."""
    eval_prompts: Annotated[int, Field(ge=0)] = 400
    """Held-out questions scored before and after training (0: no evaluation)."""
    generation_dtype: Literal["float32", "bfloat16"] = "float32"
    """The generation backend's weights dtype (the trainer stays fp32)."""
    out: str | None = None
    """A folder for records.jsonl (one line per step) and reward.png; None: none written."""


@dataclass
class TrainResult:
    """What a run did: one record per step, the held-out reward before and after (None
    without evaluation), and the two copies of the policy as the run left them."""

    records: list[dict[str, float]]
    held_out_before: float | None
    held_out_after: float | None
    wall_s: float
    policy: HfGeneration = field(repr=False)
    trainer: Trainer = field(repr=False)


# --- prompts ------------------------------------------------------------------------------


def math_prompt(item: tasks.MathItem, tokenizer: Any) -> dict[str, Any]:
    """One question as a ``DatumSpec`` row for the ``math`` task."""
    user = [{"role": "user", "content": item.question}]
    return {
        "message_log": get_formatted_message_log(user, tokenizer, add_generation_prompt=True),
        "task_name": TASK,
        "extra_env_info": {"ground_truth": item.ground_truth},
    }


def training_prompts(tokenizer: Any, seed: int) -> Iterator[dict[str, Any]]:
    """The training questions (never the held-out ones) in a seeded order, endlessly."""
    items, rng = tasks.math_items(held_out=False), random.Random(seed)
    while True:
        for item in rng.sample(items, len(items)):
            yield math_prompt(item, tokenizer)


def held_out_prompts(tokenizer: Any, count: int) -> BatchedDataDict[Any]:
    """A fixed set of ``count`` held-out questions (the same for every seed)."""
    items = random.Random(0).sample(tasks.math_items(held_out=True), count)
    return as_batch([math_prompt(item, tokenizer) for item in items])


def as_batch(rows: list[dict[str, Any]]) -> BatchedDataDict[Any]:
    return BatchedDataDict({key: [row[key] for row in rows] for key in rows[0]})


# --- the trainer ----------------------------------------------------------------------------


def token_logprobs(model: Any, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, L] log-probability of each token given the ones before it (teacher forcing, at
    ``temperature``); position 0 has none and reads 0. Right padding needs no attention
    mask: causal attention never looks right."""
    logits = model(input_ids=input_ids).logits[:, :-1].float() / temperature
    picked = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))


class Trainer:
    """The trainer's fp32 copy of the policy, its optimizer, and one GRPO step."""

    def __init__(self, config: GrpoConfig, pad_token_id: int) -> None:
        self.config, self.pad_token_id = config, pad_token_id
        torch.manual_seed(config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(config.policy, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        self.last_rollouts: BatchedDataDict[Any] | None = None
        self.last_batch: dict[str, torch.Tensor] = {}
        """The last step's rollouts and training batch ([B, L] tensors), for inspection."""

    def step(self, rollouts: BatchedDataDict[Any]) -> dict[str, float]:
        """One AdamW step on ``rollouts`` (groups of ``group_size`` rows, one after another);
        returns the loss and its metrics."""
        advantages = group_advantages(
            rollouts["total_reward"], self.config.group_size, valid=rollouts["loss_multiplier"]
        )
        batch = training_batch(rollouts, advantages, self.pad_token_id)
        logprobs = token_logprobs(self.model, batch["input_ids"], self.config.temperature)
        loss, metrics = clipped_pg_loss(
            logprobs, batch["generation_logprobs"], batch["advantages"],
            batch["token_loss_mask"], clip_low=self.config.clip, clip_high=self.config.clip,
        )  # fmt: skip
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.last_rollouts, self.last_batch = rollouts, dict(batch)
        return {"loss": loss.item(), "grad_norm": grad_norm.item(), **as_floats(metrics)}

    def weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


def as_floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


# --- the two loops ----------------------------------------------------------------------


def rollout_record(rollouts: BatchedDataDict[Any]) -> dict[str, float]:
    """The experience a step trained on: mean reward and the policy versions it came from."""
    return {
        "reward": rollouts["total_reward"].float().mean().item(),
        "min_policy_version": float(rollouts["min_policy_version"].min()),
        "max_policy_version": float(rollouts["max_policy_version"].max()),
    }


def sync_steps(
    config: GrpoConfig, policy: HfGeneration, trainer: Trainer, env: Any
) -> Iterator[dict[str, float]]:
    """Generate a step's groups, train on them, update the weights; one record per step."""
    prompts = training_prompts(policy.tokenizer, config.seed)
    for step in range(1, config.steps + 1):
        questions = as_batch(list(itertools.islice(prompts, config.prompts_per_step)))
        rollouts, _ = run_multi_turn_rollout(
            policy, questions.repeat_interleave(config.group_size), policy.tokenizer,
            {TASK: env}, MAX_SEQ_LEN, config.max_attempts, observation_format="chat_template",
        )  # fmt: skip
        record = {"step": step, **rollout_record(rollouts), **trainer.step(rollouts)}
        policy.update_weights(trainer.weights(), version=step)
        yield record


async def async_steps(
    config: GrpoConfig, policy: HfGeneration, trainer: Trainer, env: Any
) -> AsyncIterator[dict[str, float]]:
    """The same steps over an ``ExperienceStream``: the trainer trains on a thread while the
    stream goes on generating; a group older than one version is generated again."""
    groups: list[BatchedDataDict[Any]] = []
    step = 0
    async with ExperienceStream(
        policy, training_prompts(policy.tokenizer, config.seed), policy.tokenizer,
        {TASK: env}, MAX_SEQ_LEN, config.max_attempts, group_size=config.group_size,
        max_staleness=1, max_concurrent_samples=config.group_size * config.prompts_per_step,
        observation_format="chat_template",
    ) as stream:  # fmt: skip
        async for group in stream:
            groups.append(group.batch)
            if len(groups) < config.prompts_per_step:
                continue
            rollouts, groups, step = BatchedDataDict.from_batches(groups), [], step + 1
            staleness = policy.policy_version - int(rollouts["min_policy_version"].min())
            metrics = await asyncio.to_thread(trainer.step, rollouts)
            await asyncio.to_thread(policy.update_weights, trainer.weights(), version=step)
            yield {"step": step, **rollout_record(rollouts), **metrics, "staleness": staleness}
            if step == config.steps:
                return


def held_out_reward(
    config: GrpoConfig, policy: HfGeneration, prompts: BatchedDataDict[Any], env: Any
) -> float:
    """Mean reward of one episode per held-out question, at the training temperature."""
    rollouts, _ = run_multi_turn_rollout(
        policy, prompts, policy.tokenizer, {TASK: env}, MAX_SEQ_LEN, config.max_attempts,
        observation_format="chat_template",
    )  # fmt: skip
    return rollouts["total_reward"].float().mean().item()


# --- a run ----------------------------------------------------------------------------------


def train(config: GrpoConfig, log: Callable[[str], None] = print) -> TrainResult:
    """A whole run: evaluate, train ``config.steps`` steps in ``config.mode``, evaluate.
    ``log`` gets a line per step and per evaluation."""
    started = time.monotonic()
    init_ray(log_to_driver=False)
    policy = HfGeneration(
        {
            "model_name": config.policy, "temperature": config.temperature,
            "max_new_tokens": config.max_new_tokens, "seed": config.seed,
            "dtype": config.generation_dtype,
            "micro_batch_size": config.group_size * config.prompts_per_step,
        }
    )  # fmt: skip
    trainer = Trainer(config, policy.pad_id)
    env = MathEnvironment.options(num_cpus=0).remote({"max_attempts": config.max_attempts})
    try:
        evaluate = held_out_evaluation(config, policy, env, log)
        before = evaluate("before")
        records: list[dict[str, float]] = []

        def keep(record: dict[str, float]) -> None:
            records.append({**record, "elapsed_s": time.monotonic() - started})
            log(record_line(records[-1]))

        if config.mode == "sync":
            for record in sync_steps(config, policy, trainer, env):
                keep(record)
        else:
            asyncio.run(consume(async_steps(config, policy, trainer, env), keep))
        after = evaluate("after")
    finally:
        ray.kill(env)
    return TrainResult(records, before, after, time.monotonic() - started, policy, trainer)


async def consume(
    records: AsyncIterator[dict[str, float]], keep: Callable[[dict[str, float]], None]
) -> None:
    async for record in records:
        keep(record)


def held_out_evaluation(
    config: GrpoConfig, policy: HfGeneration, env: Any, log: Callable[[str], None]
) -> Callable[[str], float | None]:
    """A function that scores the held-out set now (None with ``eval_prompts`` 0)."""
    count = config.eval_prompts
    prompts = held_out_prompts(policy.tokenizer, count) if count else None

    def evaluate(when: str) -> float | None:
        if prompts is None:
            return None
        reward = held_out_reward(config, policy, prompts, env)
        log(f"held-out reward {when}: {reward:.3f} ({count} questions)")
        return reward

    return evaluate


LOGGED = ("reward", "loss", "kl_sampler_trainer", "clip_fraction", "min_policy_version")
"""The record entries a step's log line shows."""


def record_line(record: dict[str, float]) -> str:
    shown = " ".join(f"{key} {record[key]:.4g}" for key in LOGGED if key in record)
    return f"step {record['step']:g} {shown} ({record['elapsed_s']:.0f} s)"


# --- the command line and the plot -------------------------------------------------------


def parse_config(argv: list[str] | None = None) -> GrpoConfig:
    """Every field of :class:`GrpoConfig` as a flag, with its default and description."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, spec in GrpoConfig.model_fields.items():
        literal = typing.get_origin(spec.annotation) is Literal
        parser.add_argument(
            f"--{name.replace('_', '-')}", default=spec.default, help=spec.description,
            type=flag_type(spec.annotation),
            choices=typing.get_args(spec.annotation) if literal else None,
        )  # fmt: skip
    return GrpoConfig.from_mapping(vars(parser.parse_args(argv)))


def flag_type(annotation: Any) -> type:
    """int, float or str: what a flag's text becomes for a field of ``annotation``."""
    for kind in (int, float):
        if annotation is kind or kind in typing.get_args(annotation):
            return kind
    return str


def write_plot(series: dict[str, list[dict[str, float]]], path: Path, window: int = 10) -> None:
    """Training reward per step of each run in ``series`` (label -> records) as a PNG drawn
    with Pillow: each step's mean (thin) and its mean over the last ``window`` steps (thick)."""
    from PIL import Image, ImageDraw

    width, height, margin = 720, 400, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    last = max(record["step"] for records in series.values() for record in records)

    def point(step: float, reward: float) -> tuple[float, float]:
        x = margin + (width - 2 * margin) * (step - 1) / max(last - 1, 1)
        return x, height - margin - (height - 2 * margin) * reward

    for tick in range(0, 11, 2):
        y = point(1, tick / 10)[1]
        draw.line([(margin, y), (width - margin, y)], fill=(225, 225, 225))
        draw.text((12, y - 6), f"{tick / 10:.1f}", fill="black")
    for step in range(0, int(last) + 1, 10):
        draw.text((point(max(step, 1), 0)[0] - 6, height - margin + 6), str(step), fill="black")
    draw.text((width // 2 - 20, height - 22), "step", fill="black")
    title = f"training reward per step (thin) and over the last {window} steps (thick)"
    draw.text((margin, 12), title, fill="black")
    colours = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189)]
    for row, ((label, records), colour) in enumerate(zip(series.items(), colours * 3)):
        rewards = [r["reward"] for r in records]
        pale = tuple(c + (255 - c) * 2 // 3 for c in colour)
        draw.line([point(r["step"], r["reward"]) for r in records], fill=pale, width=1)
        smooth = [sum(rewards[max(i - window + 1, 0) : i + 1]) / min(i + 1, window)
                  for i in range(len(rewards))]  # fmt: skip
        draw.line([point(r["step"], m) for r, m in zip(records, smooth)], fill=colour, width=3)
        draw.text((width - margin - 150, 30 + 14 * row), label, fill=colour)
    image.save(path)


def main() -> None:
    config = parse_config()
    result = train(config)
    print(f"held-out reward {result.held_out_before} -> {result.held_out_after}, "
          f"{len(result.records)} steps in {result.wall_s:.0f} s")  # fmt: skip
    if config.out is not None:
        out = Path(config.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"config": config.model_dump(), "held_out_before": result.held_out_before,
                   "held_out_after": result.held_out_after, "wall_s": result.wall_s}  # fmt: skip
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        lines = [json.dumps(record) for record in result.records]
        (out / "records.jsonl").write_text("\n".join(lines) + "\n")
        write_plot({f"{config.mode}, seed {config.seed}": result.records}, out / "reward.png")


if __name__ == "__main__":
    main()
