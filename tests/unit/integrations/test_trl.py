"""envloop.integrations.trl against the installed TRL: a real ``trl.GRPOTrainer`` trains the
bundled policy for three steps on envloop's multi-turn math environment (a Ray actor, three
attempts per question), with envloop's rollouts and rewards; and the prompt rows and TRL
columns the rollout func builds, checked with the bundled tokenizer."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from envloop.data.datasets import PromptSample, prompt_message_logs
from envloop.demo import bundled_path, tasks
from envloop.integrations.trl import (
    MAX_POLICY_VERSION,
    MIN_POLICY_VERSION,
    TOTAL_REWARD,
    TURNS,
    envloop_reward,
    envloop_rollout_func,
    trl_sample,
)

QUESTIONS = random.Random(3).sample(tasks.math_items(held_out=True), 4)
ANSWERS = {item.question: item.ground_truth for item in QUESTIONS}
STEPS, GENERATIONS, ROWS_PER_STEP = 3, 2, 4


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(bundled_path("policy"))


def math_task(prompt: Any) -> tuple[str, dict[str, str]]:
    question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return "math", {"ground_truth": ANSWERS[question]}


@dataclass
class Rollout:
    """What one call of the rollout func saw and gave TRL."""

    step: int  # the trainer's global_step
    policy_version: int
    weights_equal: bool  # the policy's weights equal the trainer's
    served: dict[str, torch.Tensor]  # a copy of the policy's weights
    prompts: list[Any]
    output: dict[str, Any]
    batch: Any  # envloop's final batch


@dataclass
class Training:
    trainer: Any
    policy: Any
    env: Any
    rollouts: list[Rollout]
    logs: list[dict[str, float]]  # TRL's log of each step


def weights_equal(served: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor]) -> bool:
    return served.keys() == trained.keys() and all(
        torch.equal(served[k], trained[k]) for k in served
    )


def token_roles(message_log: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in message_log for _ in range(len(m["token_ids"]))]


@pytest.fixture(scope="module")
def training(ray_session, tmp_path_factory) -> Iterator[Training]:
    """GRPOTrainer, three steps of two prompts x two generations, on rollouts of the bundled
    policy (sampled hot enough that some answers are wrong twice) against ``math`` with two
    attempts per question."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from envloop.environments.registry import create_env
    from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig

    model_dir = str(bundled_path("policy"))
    policy = HfGeneration(
        HfGenerationConfig(model_name=model_dir, max_new_tokens=40, temperature=2.0, seed=1)
    )
    env = create_env("math", {"num_workers": 1, "max_attempts": 2}, num_cpus=0)
    rollout_func = envloop_rollout_func(
        policy, {"math": env}, max_seq_len=160, max_rollout_turns=3,
        sample_for_prompt=math_task, observation_format="chat_template",
    )  # fmt: skip
    rollouts: list[Rollout] = []

    def recorded(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        output = rollout_func(prompts, trainer)
        served = {k: v.clone() for k, v in policy.model.state_dict().items()}
        trained = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        step, version, same = (
            trainer.state.global_step,
            policy.policy_version,
            weights_equal(served, trained),
        )
        rollouts.append(
            Rollout(step, version, same, served, prompts, output, rollout_func.last_batch)
        )
        return output

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in ANSWERS])
    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")), max_steps=STEPS,
        per_device_train_batch_size=ROWS_PER_STEP, num_generations=GENERATIONS,
        max_completion_length=64, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=model_dir, reward_funcs=envloop_reward, args=args, train_dataset=dataset,
        rollout_func=recorded,
    )  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "rewards/envloop_reward/mean" in entry]
    yield Training(trainer, policy, env, rollouts, logs)
    ray_session.kill(env)
    policy.shutdown()


@pytest.mark.slow
@pytest.mark.ray
def test_each_step_generates_with_the_trainers_weights_of_that_step(training):
    assert training.trainer.state.global_step == STEPS
    rollouts = training.rollouts
    assert [r.step for r in rollouts] == list(range(STEPS))
    assert [r.policy_version for r in rollouts] == list(range(STEPS))
    assert all(r.weights_equal for r in rollouts)
    for r in rollouts:  # every generated token is of the step's version
        assert r.output[MIN_POLICY_VERSION] == r.output[MAX_POLICY_VERSION] == [r.step] * 4
    # Steps whose groups' rewards differ move the weights, and the next rollout has them.
    moved = [log["frac_reward_zero_std"] < 1 for log in training.logs[:-1]]
    assert any(moved)
    for before, after, step_moved in zip(rollouts, rollouts[1:], moved):
        assert weights_equal(before.served, after.served) == (not step_moved)


@pytest.mark.slow
@pytest.mark.ray
def test_trl_gets_each_prompt_per_generation_and_logs_envloops_rewards(training):
    assert len(training.logs) == STEPS
    for rollout, log in zip(training.rollouts, training.logs):
        out, batch = rollout.output, rollout.batch
        # TRL hands over each prompt num_generations times in a row.
        assert len(rollout.prompts) == ROWS_PER_STEP
        assert rollout.prompts[0::2] == rollout.prompts[1::2]
        totals = batch["total_reward"].tolist()
        assert out[TOTAL_REWARD] == totals
        assert log["rewards/envloop_reward/mean"] == pytest.approx(sum(totals) / len(totals))
        assert log["reward"] == pytest.approx(sum(totals) / len(totals))
        assert out[TURNS] == batch["num_turns"].tolist()
        assert log["envloop/total_turns"] == sum(out[TURNS])
    rewards = [r for rollout in training.rollouts for r in rollout.output[TOTAL_REWARD]]
    assert 0.0 in rewards and 1.0 in rewards


@pytest.mark.slow
@pytest.mark.ray
def test_completions_mask_environment_tokens_and_end_with_the_last_assistant_turn(training):
    retried = 0
    eos = training.trainer.processing_class.eos_token_id
    for rollout, log in zip(training.rollouts, training.logs):
        out, ended_without_eos = rollout.output, 0
        for i, message_log in enumerate(rollout.batch["message_log"]):
            prompt, completion = out["prompt_ids"][i], out["completion_ids"][i]
            logprobs, mask = out["logprobs"][i], out["env_mask"][i]
            whole = torch.cat([m["token_ids"] for m in message_log]).tolist()
            roles = token_roles(message_log)
            end = len(prompt) + len(completion)
            assert prompt + completion == whole[:end]
            assert roles[: len(prompt)] == ["user"] * len(prompt)
            # 0 exactly at environment tokens; only the final verdict is left out.
            assert mask == [int(role == "assistant") for role in roles[len(prompt) : end]]
            assert roles[end - 1] == "assistant"
            assert set(roles[end:]) == {"environment"}
            generated = [m["generation_logprobs"] for m in message_log if m["role"] == "assistant"]
            assert [lp for lp, m in zip(logprobs, mask) if m] == torch.cat(generated).tolist()
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
            retried += 0 in mask
            ended_without_eos += completion[-1] != eos
        assert log["completions/clipped_ratio"] == pytest.approx(ended_without_eos / 4)
    assert retried > 0  # some episodes answered again after "Environment: incorrect"


@pytest.mark.slow
@pytest.mark.ray
def test_the_async_engine_gives_the_sync_engines_columns(training):
    """Greedy, after training: both engines sync the trainer's step-3 weights and agree."""
    prompts = training.rollouts[0].prompts
    outputs = {}
    for engine in ("sync", "async"):
        rollout_func = envloop_rollout_func(
            training.policy, {"math": training.env}, max_seq_len=160, max_rollout_turns=3,
            sample_for_prompt=math_task, observation_format="chat_template", greedy=True,
            engine=engine,
        )  # fmt: skip
        outputs[engine] = rollout_func(prompts, training.trainer)
    assert training.policy.policy_version == STEPS
    sync, run_async = outputs["sync"], outputs["async"]
    for key in ("prompt_ids", "completion_ids", "env_mask", TOTAL_REWARD, TURNS):
        assert sync[key] == run_async[key]
    for ours, theirs in zip(sync["logprobs"], run_async["logprobs"]):
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert sync[MIN_POLICY_VERSION] == [STEPS] * 4


@pytest.mark.slow
@pytest.mark.ray
def test_a_trainer_that_trains_the_policys_own_model_is_refused(training):
    rollout_func = envloop_rollout_func(training.policy, {"math": training.env}, max_seq_len=160)
    trainer = training.trainer
    sharing = SimpleNamespace(
        state=trainer.state, accelerator=trainer.accelerator, model=training.policy.model
    )
    with pytest.raises(ValueError, match="shares its weights with the policy's model"):
        rollout_func.sync_weights(sharing)


def test_prompts_become_envloop_rows_with_their_task_and_metadata(tokenizer):
    rollout_func = envloop_rollout_func(
        None, {"math": None}, max_seq_len=64, tokenizer=tokenizer, sample_for_prompt=math_task
    )
    question = QUESTIONS[0].question
    conversation = [{"role": "user", "content": question}]
    batch = rollout_func.input_batch([conversation, question])
    expected = prompt_message_logs(
        [PromptSample(0, "math", conversation, ANSWERS[question], {})], tokenizer
    )[0]
    for log in batch["message_log"]:  # a string is the user's message, chat-templated
        assert [m["content"] for m in log] == [question]
        assert torch.equal(log[0]["token_ids"], expected[0]["token_ids"])
    assert batch["task_name"] == ["math", "math"]
    assert batch["extra_env_info"] == [{"ground_truth": ANSWERS[question]}] * 2
    assert batch["length"] == [len(expected[0]["token_ids"])] * 2

    raw = envloop_rollout_func(None, {"math": None}, max_seq_len=64, tokenizer=tokenizer,
                               text_prompts="raw")  # fmt: skip
    (log,) = raw.input_batch(["What is 1 + 2?"])["message_log"]
    assert log[0]["token_ids"].tolist() == tokenizer("What is 1 + 2?")["input_ids"]
    assert raw.input_batch(["x"])["extra_env_info"] == [{}]  # the only task, no metadata


def test_unknown_task_and_ambiguous_tasks_are_refused(tokenizer):
    wrong = envloop_rollout_func(
        None, {"math": None}, max_seq_len=64, tokenizer=tokenizer,
        sample_for_prompt=lambda prompt: ("mth", {}),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"No task named 'mth'\. Known: math\. Did you mean"):
        wrong.input_batch(["What is 1 + 2?"])
    with pytest.raises(ValueError) as error:
        envloop_rollout_func(None, {"math": None, "code": None}, max_seq_len=8, engine="fast",
                             tokenizer=tokenizer, observation_format="html")  # fmt: skip
    assert str(error.value) == (
        "Invalid envloop_rollout_func arguments:\n"
        "  - task_to_env has 2 tasks (math, code): pass sample_for_prompt, which names each "
        "prompt's task\n"
        "  - engine must be 'sync' or 'async', got 'fast'\n"
        "  - observation_format: 'html' is not one of raw, chat_template"
    )


def test_failed_and_empty_samples_are_masked_and_unscored():
    ids = torch.tensor
    log = [
        {"role": "user", "token_ids": ids([1, 2])},
        {"role": "assistant", "token_ids": ids([3]), "generation_logprobs": ids([-0.5])},
        {"role": "environment", "token_ids": ids([4, 5])},
    ]
    failed = trl_sample(log, prompt_messages=1, pad_id=0, trained=False)
    assert (failed.completion_ids, failed.env_mask) == ([3], [0])
    empty = trl_sample(log[:1], prompt_messages=1, pad_id=9)
    assert (empty.completion_ids, empty.logprobs, empty.env_mask) == ([9], [0.0], [0])
    logged: dict[str, float] = {}
    rewards = envloop_reward(
        ["a", "b"], envloop_total_reward=[0.5, 1.0], envloop_error=["env math: boom", None],
        envloop_rollout_metrics=[{"total_turns": 3, "note": "x"}] * 2,
        log_metric=logged.__setitem__,
    )  # fmt: skip
    assert rewards == [None, 1.0]
    assert logged == {"envloop/total_turns": 3.0}
    with pytest.raises(ValueError, match="envloop_total_reward"):
        envloop_reward(["a"])
