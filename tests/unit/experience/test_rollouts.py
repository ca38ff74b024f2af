"""The batched rollout engine on a scripted policy and in-process toy environments."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from envloop.config.errors import ConfigError
from envloop.experience.rollouts import (
    EnvironmentStepError,
    calculate_rewards,
    generate_responses,
    run_multi_turn_rollout,
)
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import calc_sample, guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import (
    BadContractEnv,
    CalculatorEnv,
    ComponentRewardEnv,
    EchoEnv,
    FailingEnv,
    GuessNumberEnv,
)

ENVS = {"calc": CalculatorEnv(), "guess": GuessNumberEnv()}


@pytest.fixture
def policy(tiny_tokenizer):
    return ScriptedGeneration(tiny_tokenizer, scripted_respond)


def roles(log):
    return [m["role"] for m in log]


def contents(log):
    return [m["content"] for m in log]


def test_calculator_multi_turn_is_exact(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [calc_sample("What is 12 * 7 + 1?", 85)])
    final, metrics = run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, max_seq_len=256)
    log = final["message_log"][0]
    assert roles(log) == [
        "system", "user", "assistant", "tool", "assistant", "tool", "assistant", "environment",
    ]  # fmt: skip
    assert contents(log)[2:] == [
        "<call>12 * 7</call>", "<result>84</result>",
        "<call>84 + 1</call>", "<result>85</result>",
        "<answer>85</answer>", "correct",
    ]  # fmt: skip
    # Stop strings reach the policy per turn: the batch's, then the environment's.
    assert policy.calls == [[["</call>"]], [["</call>", "</answer>"]], [["</call>", "</answer>"]]]
    assert final["extra_env_info"][0] == {"target": 85, "calls": 2, "answer": "85"}
    assert final["total_reward"].tolist() == [1.0]
    assert final["turn_rewards"] == [[0.0, 0.0, 1.0]]
    assert final["num_turns"].tolist() == [3]
    assert final["terminated"].tolist() == [True] and final["truncated"].tolist() == [False]
    assert metrics["total_turns"] == 3 and metrics["natural_termination_rate"] == 1.0
    assert metrics["max_turns_reached_rate"] == 0.0 and metrics["env_error_rate"] == 0.0


def test_generated_and_observation_tokens_are_kept_exactly(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [calc_sample("What is 12 * 7 + 1?", 85)])
    final, metrics = run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, max_seq_len=256)
    log = final["message_log"][0]
    for message in log[2:]:
        expected = tiny_tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        assert message["token_ids"].tolist() == expected
        assert message["token_ids"].dtype == torch.long
    for message in log[2::2]:
        assert message["generation_logprobs"].tolist() == [-1.0] * len(message["token_ids"])
    gen = sum(len(m["token_ids"]) for m in log[2::2])
    env = sum(len(m["token_ids"]) for m in log[3::2])
    assert metrics["mean_gen_tokens_per_sample"] == gen
    assert metrics["mean_env_tokens_per_sample"] == env
    assert metrics["mean_total_tokens_per_sample"] == sum(len(m["token_ids"]) for m in log)


def test_guess_the_number_binary_search(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), guess_sample(50), guess_sample(99, 3)])
    final, metrics = run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, max_seq_len=512)
    guesses = [
        [m["content"] for m in log if m["role"] == "assistant"] for log in final["message_log"]
    ]
    assert guesses[0] == ["<guess>50</guess>", "<guess>25</guess>", "<guess>37</guess>"]
    assert guesses[1] == ["<guess>50</guess>"]
    assert guesses[2] == ["<guess>50</guess>", "<guess>75</guess>", "<guess>88</guess>"]
    assert contents(final["message_log"][0])[-1] == "correct"
    assert final["total_reward"].tolist() == [1.0, 1.0, 0.0]
    assert final["num_turns"].tolist() == [3, 1, 3]
    assert [md["guesses"] for md in final["extra_env_info"]] == [3, 1, 3]
    assert metrics["total_turns"] == 7 and metrics["max_turns_per_sample"] == 3
    assert metrics["avg_turns_per_sample"] == pytest.approx(7 / 3)


def test_max_turns_reached(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), guess_sample(50)])
    final, metrics = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, ENVS, max_seq_len=512, max_rollout_turns=2
    )
    assert final["num_turns"].tolist() == [2, 1]
    assert metrics["max_turns_reached_rate"] == 0.5
    assert metrics["natural_termination_rate"] == 0.5


def test_on_turn_reports_progress_after_every_turn(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37), guess_sample(50), guess_sample(99, 3)])
    seen = []
    final, metrics = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, ENVS, max_seq_len=512, on_turn=seen.append
    )
    replies = [[m for m in log if m["role"] == "assistant"] for log in final["message_log"]]
    tokens_after = [
        sum(len(m["token_ids"]) for r in replies for m in r[:turn]) for turn in (1, 2, 3)
    ]
    assert [(p.samples, p.samples_done, p.turns, p.generated_tokens) for p in seen] == [
        (3, 1, 3, tokens_after[0]),  # 50 is right at once
        (3, 1, 5, tokens_after[1]),
        (3, 3, 7, tokens_after[2]),
    ]
    assert [p.generation_s for p in seen] == sorted(p.generation_s for p in seen)
    assert seen[-1].generation_s == metrics["timing/generation_s"]
    assert metrics["total_generated_tokens"] == tokens_after[2] == 53
    assert metrics["generation_tokens_per_s"] == 53 / metrics["timing/generation_s"]
    assert seen[-1].tokens_per_s == metrics["generation_tokens_per_s"]


def test_timing_metrics_name_every_phase(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    _, metrics = run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, max_seq_len=512)
    assert [k for k in metrics if k.startswith("timing/")] == [
        "timing/flatten_s", "timing/generation_s", "timing/gen_bookkeeping_s",
        "timing/env_startup_s", "timing/env_step_s", "timing/rewards_and_status_s",
        "timing/obs_tokenization_s",
    ]  # fmt: skip
    assert metrics["env_time_s"] == metrics["timing/env_step_s"]


def test_on_turn_must_be_callable(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    with pytest.raises(ConfigError, match=r"on_turn: expected a function \| None, got str"):
        run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, 512, on_turn="print")


def test_mixed_tasks_keep_batch_order(tiny_tokenizer, policy):
    samples = [
        guess_sample(37),
        calc_sample("What is 3 + 4?", 7),
        guess_sample(50),
        calc_sample("What is 9 - 2?", 7),
    ]
    final, _ = run_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, ENVS, max_seq_len=512
    )
    assert final["task_name"] == ["guess", "calc", "guess", "calc"]
    assert final["total_reward"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert final["num_turns"].tolist() == [3, 2, 1, 1]
    assert contents(final["message_log"][1])[-2:] == ["<answer>7</answer>", "correct"]
    assert contents(final["message_log"][3])[-2:] == ["<answer>6</answer>", "incorrect"]


def test_input_batch_is_not_mutated(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [calc_sample("What is 3 + 4?", 7), guess_sample(37)])
    before = copy.deepcopy(batch)
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, max_seq_len=512)
    assert [len(log) for log in batch["message_log"]] == [2, 1]
    assert batch["extra_env_info"] == before["extra_env_info"]
    assert batch["loss_multiplier"] == before["loss_multiplier"]
    assert len(final["message_log"][0]) == 6


def test_observation_overflow_truncates_to_exactly_max_seq_len(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "ok")
    samples = [{"task": "echo", "prompt": p} for p in ("hi", "a longer prompt here")]
    batch = make_batch(tiny_tokenizer, samples)
    prompt_lengths = batch["length"]
    max_seq_len = max(prompt_lengths) + 20
    final, metrics = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"echo": EchoEnv()}, max_seq_len=max_seq_len
    )
    for log in final["message_log"]:
        assert sum(len(m["token_ids"]) for m in log) == max_seq_len
        assert log[-1]["role"] == "environment"
    assert final["truncated"].tolist() == [True, True]
    assert final["terminated"].tolist() == [False, False]
    assert metrics["truncation_rate"] == 1.0
    # The cut observation's content is the text of the tokens the policy saw.
    cut = final["message_log"][1][-1]
    assert cut["content"] == tiny_tokenizer.decode(cut["token_ids"].tolist())


def test_generation_budget_never_exceeds_max_seq_len(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "The quick brown fox " * 20)
    batch = make_batch(tiny_tokenizer, [{"task": "echo", "prompt": "go"}])
    max_seq_len = batch["length"][0] + 7
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"echo": EchoEnv()}, max_seq_len=max_seq_len
    )
    log = final["message_log"][0]
    assert roles(log) == ["user", "assistant"]  # nothing of the observation fits
    assert len(log[-1]["token_ids"]) == 7
    assert final["truncated"].tolist() == [True]
    assert final["turn_rewards"] == [[0.5]]  # the environment still scored the response


def test_prompt_of_exactly_max_seq_len_takes_no_turn(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, ENVS, max_seq_len=batch["length"][0]
    )
    assert final["num_turns"].tolist() == [0]
    assert final["truncated"].tolist() == [True]
    assert policy.calls == []


def test_dict_rewards_mix_with_scalar_rewards(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "four")
    samples = [{"task": "parts", "prompt": "a"}, {"task": "echo", "prompt": "b"}]
    envs = {"parts": ComponentRewardEnv(), "echo": EchoEnv()}
    final, _ = run_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, envs, 512, max_rollout_turns=2
    )
    assert final["reward/format"].tolist() == [0.25, 0.0]
    assert final["reward/length"].tolist() == pytest.approx([0.04, 0.0])
    assert final["reward_components"] == [["reward/format", "reward/length"], []]
    assert final["total_reward"].tolist() == pytest.approx([0.29, 1.0])
    assert final["num_turns"].tolist() == [1, 2]


def test_chat_template_observations_are_token_exact(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [calc_sample("What is 12 * 7 + 1?", 85)])
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, ENVS, max_seq_len=512, observation_format="chat_template"
    )
    log = final["message_log"][0]
    conversation = [{"role": m["role"], "content": m["content"]} for m in log]
    assert contents(log)[2:4] == ["<call>12 * 7</call>", "<result>84</result>"]
    prompt = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 12 * 7 + 1?"},
    ]
    expected = tiny_tokenizer.apply_chat_template(
        prompt + conversation[2:], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert torch.cat([m["token_ids"] for m in log]).tolist() == expected


def test_chat_template_after_eos_terminated_responses(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "ok")
    batch = make_batch(
        tiny_tokenizer, [{"task": "echo", "prompt": "hi", "metadata": {"reply": "again"}}]
    )
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"echo": EchoEnv()}, max_seq_len=512,
        max_rollout_turns=2, observation_format="chat_template",
    )  # fmt: skip
    log = final["message_log"][0]
    assert log[1]["token_ids"][-1].item() == tiny_tokenizer.eos_token_id
    conversation = [{"role": "user", "content": "hi"}] + [
        {"role": m["role"], "content": m["content"]} for m in log[1:]
    ]
    expected = tiny_tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert torch.cat([m["token_ids"] for m in log]).tolist() == expected


def test_failing_environment_fails_only_its_samples(tiny_tokenizer, policy):
    samples = [guess_sample(37), calc_sample("What is 3 + 4?", 7), guess_sample(50)]
    envs = {"guess": GuessNumberEnv(), "calc": FailingEnv()}
    final, metrics = run_multi_turn_rollout(
        policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, envs, max_seq_len=512
    )
    assert final["total_reward"].tolist() == [1.0, 0.0, 1.0]
    assert final["loss_multiplier"] == [1.0, 0.0, 1.0]
    assert final["env_error"][0] is None and final["env_error"][2] is None
    assert "env calc.step raised" in final["env_error"][1]
    assert "boom: the failing environment always raises" in final["env_error"][1]
    assert roles(final["message_log"][1]) == ["system", "user", "assistant"]
    assert metrics["env_error_rate"] == pytest.approx(1 / 3)


def test_failing_environment_raise_mode(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [calc_sample("What is 3 + 4?", 7)])
    with pytest.raises(EnvironmentStepError, match=r"env calc\.step raised") as info:
        run_multi_turn_rollout(
            policy, batch, tiny_tokenizer, {"calc": FailingEnv()}, 512, on_env_error="raise"
        )
    assert "boom" in str(info.value) and "Traceback" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


class BlockedEnv(EchoEnv):
    """Its step waits until the test releases it: no timeout can see it finish."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def step(self, message_log_batch, metadata, *args, **kwargs):
        self.release.wait()
        return super().step(message_log_batch, metadata)


def test_slow_environment_times_out_as_data(tiny_tokenizer, policy):
    # a step that cannot finish, and a timeout generous for the quick one on a loaded machine
    samples = [guess_sample(50), {"task": "slow", "prompt": "x"}]
    blocked = BlockedEnv()
    envs = {"guess": GuessNumberEnv(), "slow": blocked}
    try:
        final, metrics = run_multi_turn_rollout(
            policy, make_batch(tiny_tokenizer, samples), tiny_tokenizer, envs, 512,
            env_step_timeout_s=5.0,
        )  # fmt: skip
    finally:
        blocked.release.set()
    assert final["env_error"] == [None, "env slow.step timed out after 5.0 s"]
    assert final["total_reward"].tolist() == [1.0, 0.0]
    assert metrics["env_error_rate"] == 0.5


def test_environment_breaking_the_contract_is_reported(tiny_tokenizer, policy):
    batch = make_batch(
        tiny_tokenizer, [{"task": "bad", "prompt": "a"}, {"task": "bad", "prompt": "b"}]
    )
    final, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, {"bad": BadContractEnv()}, 512)
    error = final["env_error"][0]
    assert "env bad.step broke the EnvironmentReturn contract" in error
    assert "observations: expected 2 entries (one per sample), got 1" in error
    assert "rewards: expected a float tensor, got torch.int64" in error


def test_unknown_task_names_the_known_ones(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [{"task": "gues", "prompt": "a"}])
    with pytest.raises(ValueError, match=r"'gues'.*Known: calc, guess.*Did you mean 'guess'"):
        run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, 512)


def test_bad_inputs_have_clear_errors(tiny_tokenizer, policy):
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    with pytest.raises(ValueError, match=r"max_seq_len=4 is smaller than 1 prompt\(s\)"):
        run_multi_turn_rollout(policy, batch, tiny_tokenizer, ENVS, 4)
    no_ids = batch.copy()
    no_ids["message_log"] = [[{"role": "user", "content": "hi"}]]
    with pytest.raises(ValueError, match=r"sample 0, message 0 \(role 'user'\) has no 'token_ids'"):
        run_multi_turn_rollout(policy, no_ids, tiny_tokenizer, ENVS, 512)
    floats = batch.copy()
    floats["message_log"] = [[{"role": "user", "content": "hi", "token_ids": torch.ones(3)}]]
    with pytest.raises(
        ValueError, match=r"must be a 1-D int64 tensor, got a \(3,\) torch\.float32"
    ):
        run_multi_turn_rollout(policy, floats, tiny_tokenizer, ENVS, 512)
    with pytest.raises(ConfigError) as info:
        run_multi_turn_rollout(
            policy, batch, tiny_tokenizer, ENVS, 512, observation_format="xml", on_env_eror="raise"
        )
    assert "on_env_eror: unknown option. Did you mean 'on_env_error'?" in str(info.value)
    assert "observation_format: 'xml' is not one of raw, chat_template" in str(info.value)


def test_tokenizer_without_pad_token_is_rejected(tiny_tokenizer, policy):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = None
    batch = make_batch(tiny_tokenizer, [guess_sample(37)])
    with pytest.raises(ValueError, match="has no pad token; set one"):
        run_multi_turn_rollout(policy, batch, tokenizer, ENVS, 512)


def test_generate_responses_and_calculate_rewards(tiny_tokenizer, policy):
    from envloop.data.llm_message_utils import batched_message_log_to_flat_message
    from envloop.distributed.batched_data_dict import BatchedDataDict

    batch = make_batch(tiny_tokenizer, [guess_sample(37), calc_sample("What is 9 - 2?", 7)])
    flat, lengths = batched_message_log_to_flat_message(
        batch["message_log"], {"token_ids": tiny_tokenizer.pad_token_id}
    )
    gen_input = BatchedDataDict(
        input_ids=flat["token_ids"], input_lengths=lengths, stop_strings=batch["stop_strings"]
    )
    batch, generated, gen_metrics = generate_responses(
        policy, gen_input, batch, tiny_tokenizer, lengths
    )
    assert [log[-1]["content"] for log in batch["message_log"]] == [
        "<guess>50</guess>", "<answer>6</answer>",
    ]  # fmt: skip
    assert gen_metrics["total_generated_tokens"] == sum(len(g) for g in generated)
    ret = calculate_rewards(batch, ENVS)
    assert ret.rewards.tolist() == [0.0, 0.0]
    assert ret.terminateds.tolist() == [False, True]
    assert [o["content"] for o in ret.observations] == ["lower", "incorrect"]
    assert ret.answers == [None, "6"]
