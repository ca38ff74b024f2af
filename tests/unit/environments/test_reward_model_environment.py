"""RewardModelEnvironment: exact scores from a tiny reward model loaded with from_pretrained."""

from __future__ import annotations

import math
import random
import types
import warnings
import weakref

import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from envloop.config.env_fields import env_config_problems
from envloop.config.errors import ConfigError
from envloop.data.packing import ALGORITHMS
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments import check_env, reward_model_environment
from envloop.environments.reward_model.batching import plan_batches, score_sequences
from envloop.environments.reward_model.checks import round_up
from envloop.environments.reward_model.config import (
    DEFAULTS,
    UnusedConfigWarning,
    unused_keys,
    validate_config,
)
from envloop.environments.reward_model.packing import packing_problem, score_packed
from envloop.environments.reward_model_environment import (
    RewardModelEnvironment,
    reward_model_ray_options,
)
from tests.fixtures.chat_templates import (
    CHATML_STRICT_ROLES_TEMPLATE,
    build_chatml_tokenizer,
    build_llama3_tokenizer,
)
from tests.fixtures.tiny_reward_model import build_tiny_reward_model, save_tiny_reward_model

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "answers", "42"]


def conversation(i: int) -> list[dict[str, str]]:
    """A deterministic conversation whose length grows with ``i`` (some have a system turn)."""
    user = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(2 + 3 * i))
    log = [{"role": "user", "content": f"Question {i}: {user}?"}]
    log.append({"role": "assistant", "content": f"<answer>{i * 7}</answer>"})
    return ([{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []) + log


LOGS = [conversation(i) for i in (4, 0, 9, 2, 7, 1, 5)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))


def make_env(rm_dir, **options) -> RewardModelEnvironment:
    """The minimal envloop config; ``logprob_mb_tokens`` given: dynamic batching, else fixed."""
    cfg = {"model_name": str(rm_dir), "precision": "float32", "max_model_len": 512}
    budget = options.pop("logprob_mb_tokens", None)
    cfg["dynamic_batching"] = {"enabled": budget is not None, "logprob_mb_tokens": budget or 512}
    return RewardModelEnvironment({**cfg, **options})


def direct_score(model, tokenizer, log) -> float:
    text = tokenizer.apply_chat_template(log, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


def test_scores_equal_a_direct_forward_pass_on_the_templated_text(rm_dir):
    env = make_env(rm_dir, batch_size=4)
    ret = env.step(LOGS, [{"i": i} for i in range(len(LOGS))])
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    assert tokenizer.apply_chat_template(LOGS[1], tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQuestion 0: the quick?"
        "<|im_end|>\n<|im_start|>assistant\n<answer>0</answer><|im_end|>\n"
    )
    expected = torch.tensor([direct_score(model, tokenizer, log) for log in LOGS])
    assert ret.rewards.dtype == torch.float32
    assert torch.allclose(ret.rewards, expected, atol=1e-5, rtol=0)
    assert expected.std() > 0.05  # the scores really differ between conversations
    assert ret.observations == [
        {"role": "environment", "content": f"Environment: reward {r:.4f}"}
        for r in ret.rewards.tolist()
    ]
    assert ret.answers == [log[-1]["content"] for log in LOGS]
    assert ret.terminateds.tolist() == [True] * len(LOGS)
    assert ret.next_stop_strings == [None] * len(LOGS)
    assert ret.metadata == [{"i": i} for i in range(len(LOGS))]


def test_batched_and_one_by_one_scores_agree(rm_dir):
    batched = make_env(rm_dir, batch_size=4).step(LOGS, [None] * len(LOGS)).rewards
    single = make_env(rm_dir, batch_size=1)
    one_by_one = torch.cat([single.step([log], [None]).rewards for log in LOGS])
    assert (batched - one_by_one).abs().max().item() < 1e-5


def test_padding_side_does_not_change_scores(rm_dir):
    env = make_env(rm_dir, batch_size=len(LOGS))
    right = env.step(LOGS, [None] * len(LOGS)).rewards
    env.tokenizer.padding_side = "left"
    left = env.step(LOGS, [None] * len(LOGS)).rewards
    assert (right - left).abs().max().item() < 1e-5


def test_dynamic_batching_gives_the_fixed_scores_in_input_order(rm_dir):
    logs = [conversation(i) for i in (11, 0, 3, 12, 1, 6, 2, 9, 4, 10)]
    lengths = make_env(rm_dir).preprocess_data(logs)["input_lengths"].tolist()
    fixed = make_env(rm_dir, batch_size=4).step(logs, [None] * 10).rewards
    budget = 2 * max(lengths)
    dynamic = make_env(rm_dir, batch_size=4, logprob_mb_tokens=budget, max_model_len=budget)
    assert (dynamic.step(logs, [None] * 10).rewards - fixed).abs().max().item() < 1e-5
    batches = plan_batches(lengths, 4, budget)
    assert sorted(i for b in batches for i in b) == list(range(10))
    assert all(len(b) <= 4 and len(b) * lengths[b[0]] <= budget for b in batches)
    assert [lengths[b[0]] for b in batches] == sorted(
        (lengths[b[0]] for b in batches), reverse=True
    )


def test_preprocess_data_templates_and_right_pads(rm_dir):
    env = make_env(rm_dir)
    tokenizer = env.tokenizer
    data = env.preprocess_data(LOGS[:2])
    assert isinstance(data, BatchedDataDict)
    ids = [
        tokenizer(tokenizer.apply_chat_template(log, tokenize=False))["input_ids"]
        for log in LOGS[:2]
    ]
    assert data["input_lengths"].tolist() == [len(ids[0]), len(ids[1])]
    assert data["input_ids"].shape == (2, max(map(len, ids)))
    for row, expected in zip(data["input_ids"].tolist(), ids):
        assert row == expected + [tokenizer.pad_token_id] * (len(row) - len(expected))
    assert data["truncated"].tolist() == [False, False]
    with pytest.raises(ValueError, match="empty conversation"):
        env.preprocess_data([LOGS[0], []])


def test_long_conversations_are_cut_from_the_left_and_counted(rm_dir):
    env = make_env(rm_dir, max_model_len=48)
    long_log = conversation(30)
    full = env.tokenizer(env.tokenizer.apply_chat_template(long_log, tokenize=False))["input_ids"]
    data = env.preprocess_data([long_log, LOGS[5]])
    assert len(full) > 48
    assert data["input_ids"][0].tolist() == full[-48:]
    assert data["input_lengths"].tolist()[0] == 48 and data["truncated"].tolist() == [True, False]
    text = env.tokenizer.decode(full[-48:])
    assert text.endswith("<|im_start|>assistant\n<answer>210</answer><|im_end|>\n")
    ret = env.step([long_log, LOGS[5], long_log], [None] * 3)
    model = env.model
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([full[-48:]])).logits[0, 0].item()
    assert ret.rewards[0].item() == pytest.approx(expected, abs=1e-5)
    assert ret.rewards[2].item() == pytest.approx(expected, abs=1e-5)
    _, metrics = env.global_post_process_and_metrics(BatchedDataDict(total_reward=ret.rewards))
    assert metrics["reward_model_env/num_truncated"] == 2
    _, metrics = env.global_post_process_and_metrics(BatchedDataDict(total_reward=ret.rewards))
    assert metrics["reward_model_env/num_truncated"] == 0


def test_separate_tokenizer_and_bos_kept_when_cutting(tmp_path):
    tokenizer = build_llama3_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    build_tiny_reward_model(len(tokenizer), tokenizer.pad_token_id).save_pretrained(tmp_path / "m")
    env = RewardModelEnvironment(
        {"model_name": str(tmp_path / "m"), "tokenizer": {"name": str(tmp_path / "tok")},
         "precision": "float32", "max_model_len": 20}
    )  # fmt: skip
    ids = env.preprocess_data([conversation(8)])["input_ids"][0].tolist()
    full = tokenizer(
        tokenizer.apply_chat_template(conversation(8), tokenize=False), add_special_tokens=False
    )["input_ids"]
    assert full[0] == tokenizer.bos_token_id and len(full) > 20
    assert ids == full[:1] + full[-19:]


def test_malformed_conversations_get_zero_and_an_explanation(rm_dir, tmp_path):
    build_chatml_tokenizer(CHATML_STRICT_ROLES_TEMPLATE).save_pretrained(tmp_path)
    env = make_env(rm_dir, tokenizer=str(tmp_path), batch_size=2)
    env_turn = [*LOGS[0], {"role": "environment", "content": "hi"}]
    logs = [LOGS[0], [], [{"role": "user"}], "text", env_turn, LOGS[2]]
    ret = env.step(logs, [None] * len(logs))
    alone = make_env(rm_dir).step([LOGS[0], LOGS[2]], [None, None]).rewards
    assert ret.rewards[[0, 5]].tolist() == pytest.approx(alone.tolist(), abs=1e-5)
    assert ret.rewards[1:5].tolist() == [0.0] * 4
    assert [o["content"] for o in ret.observations[1:5]] == [
        "Environment: reward 0 (not scored: empty conversation)",
        "Environment: reward 0 (not scored: message 0 is not a {'role': str, 'content': str} dict)",
        "Environment: reward 0 (not scored: expected a list of messages, got str)",
        "Environment: reward 0 (not scored: chat template failed "
        "(TemplateError: Unknown role: environment))",
    ]
    assert ret.answers == [
        LOGS[0][-1]["content"],
        None,
        None,
        None,
        LOGS[0][-1]["content"],
        LOGS[2][-1]["content"],
    ]


def test_metrics_are_exact(rm_dir):
    env = make_env(rm_dir)
    batch = BatchedDataDict(total_reward=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    _, metrics = env.global_post_process_and_metrics(batch)
    assert metrics == {
        "reward_model_env/num_samples": 4,
        "reward_model_env/num_truncated": 0,
        "reward_model_env/num_unscored": 0,
        "reward_model_env/num_over_max_parse_chars": 0,
        "reward_model_env/mean_reward": 2.5,
        "reward_model_env/std_reward": pytest.approx(math.sqrt(1.25)),
        "reward_model_env/min_reward": 1.0,
        "reward_model_env/max_reward": 4.0,
    }
    _, empty = env.global_post_process_and_metrics(BatchedDataDict())
    assert (
        empty["reward_model_env/num_samples"] == 0 and empty["reward_model_env/mean_reward"] == 0.0
    )


# --- max_parse_chars and poisoned samples -------------------------------------------------

OVER_CAP = "over max_parse_chars=1,000,000; raise max_parse_chars to score it"


def qa(response: str, question: str = "Question?") -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": response}]


def test_megabyte_conversations_over_the_default_cap_are_not_tokenized(rm_dir):
    env = make_env(rm_dir)
    logs = [LOGS[0], qa("<answer>" * 150_000), qa("x" * 600_000, "y" * 600_000), LOGS[2]]
    ret = env.step(logs, [{"id": i} for i in range(4)])
    alone = env.step([LOGS[0], LOGS[2]], [None, None]).rewards
    assert ret.rewards[[0, 3]].tolist() == pytest.approx(alone.tolist(), abs=1e-5)
    assert ret.rewards[1:3].tolist() == [0.0, 0.0]
    reasons = [
        f"conversation has 1,200,009 characters, {OVER_CAP}",
        f"conversation has 1,200,000 characters, {OVER_CAP}",  # the prompt counts too
    ]
    assert ret.metadata == [
        {"id": 0},
        {"id": 1, "reward_model_error": reasons[0]},
        {"id": 2, "reward_model_error": reasons[1]},
        {"id": 3},
    ]
    assert [o["content"] for o in ret.observations[1:3]] == [
        f"Environment: reward 0 (not scored: {why})" for why in reasons
    ]
    assert ret.answers == [LOGS[0][-1]["content"], None, None, LOGS[2][-1]["content"]]
    _, metrics = env.global_post_process_and_metrics(BatchedDataDict(total_reward=ret.rewards))
    assert metrics["reward_model_env/num_unscored"] == 2
    assert metrics["reward_model_env/num_over_max_parse_chars"] == 2


def test_a_megabyte_conversation_under_the_default_cap_is_cut_and_scored(rm_dir):
    env = make_env(rm_dir)
    log = qa("<answer>" * 110_000)  # 880,009 characters: 440,000+ tokens, cut to 512
    ret = env.step([log, LOGS[0]], [{"id": 0}, {"id": 1}])
    full = env.tokenizer(env.tokenizer.apply_chat_template(log, tokenize=False))["input_ids"]
    with torch.no_grad():
        expected = env.model(input_ids=torch.tensor([full[-512:]])).logits[0, 0].item()
    assert ret.rewards[0].item() == pytest.approx(expected, abs=1e-5)
    assert ret.metadata == [{"id": 0}, {"id": 1}]
    _, metrics = env.global_post_process_and_metrics(BatchedDataDict(total_reward=ret.rewards))
    assert (
        metrics["reward_model_env/num_truncated"],
        metrics["reward_model_env/num_unscored"],
    ) == (1, 0)


def test_conversations_up_to_the_cap_are_scored_and_longer_ones_are_not(rm_dir):
    capped = make_env(rm_dir, max_parse_chars=100)
    at_cap, over = qa("a" * 91), qa("a" * 92)  # 9 + 91 and 9 + 92 characters
    ret = capped.step([at_cap, over], [None, None])
    assert ret.rewards[0].item() == pytest.approx(
        make_env(rm_dir).step([at_cap], [None]).rewards.item(), abs=1e-5
    )
    assert ret.rewards[1].item() == 0.0
    assert ret.metadata == [
        None,
        {
            "reward_model_error": "conversation has 101 characters, over max_parse_chars=100; "
            "raise max_parse_chars to score it"
        },
    ]
    with pytest.raises(ValueError, match="conversation has 101 characters"):
        capped.preprocess_data([over])


POISONS = {
    "content_huge_int": (
        [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": 10**5000}],
        "message 1 is not a {'role': str, 'content': str} dict",
    ),
    "content_parts": (
        [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}],
        "message 0 is not a {'role': str, 'content': str} dict",
    ),
    "missing_content": (
        [{"role": "user"}],
        "message 0 is not a {'role': str, 'content': str} dict",
    ),
    "not_a_list": (None, "expected a list of messages, got NoneType"),
    "empty": ([], "empty conversation"),
}


@pytest.mark.parametrize("poison, why", list(POISONS.values()), ids=list(POISONS))
def test_one_poisoned_conversation_scores_zero_and_the_others_are_scored(rm_dir, poison, why):
    env = make_env(rm_dir, batch_size=2)
    metadata = [{"ground_truth": 10**5000}, {"id": 1}, None]  # metadata is never read
    ret = env.step([LOGS[0], poison, LOGS[2]], metadata)
    alone = make_env(rm_dir).step([LOGS[0], LOGS[2]], [None, None]).rewards
    assert ret.rewards[[0, 2]].tolist() == pytest.approx(alone.tolist(), abs=1e-5)
    assert ret.rewards[1].item() == 0.0
    assert ret.metadata[0] is metadata[0] and ret.metadata[2] is None
    assert ret.metadata[1] == {"id": 1, "reward_model_error": why}
    assert ret.observations[1]["content"] == f"Environment: reward 0 (not scored: {why})"


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_checkpoint_path_loads_weights_on_top(rm_dir, tmp_path, suffix):
    other = save_tiny_reward_model(tmp_path / "other", seed=1)
    state = AutoModelForSequenceClassification.from_pretrained(other).state_dict()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    loaded = make_env(rm_dir, checkpoint_path=str(path)).step(LOGS, [None] * len(LOGS)).rewards
    reference = make_env(other).step(LOGS, [None] * len(LOGS)).rewards
    base = make_env(rm_dir).step(LOGS, [None] * len(LOGS)).rewards
    assert (loaded - reference).abs().max().item() < 1e-6
    assert (loaded - base).abs().max().item() > 0.1


def test_bfloat16_precision(rm_dir):
    env = make_env(rm_dir, precision="bfloat16")
    assert env.model.dtype == torch.bfloat16
    rewards = env.step(LOGS[:2], [None, None]).rewards
    assert rewards.dtype == torch.float32
    full = make_env(rm_dir).step(LOGS[:2], [None, None]).rewards
    assert (rewards - full).abs().max().item() < 0.5


def test_shutdown_frees_the_model_and_del_calls_it(rm_dir):
    env = make_env(rm_dir)
    env.step(LOGS[:1], [None])
    model_ref = weakref.ref(env.model)
    env.shutdown()
    assert env.model is None and model_ref() is None
    env.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="after shutdown"):
        env.step(LOGS[:1], [None])
    env = make_env(rm_dir)
    model_ref = weakref.ref(env.model)
    del env
    assert model_ref() is None


def test_config_errors_list_every_bad_key(tmp_path):
    bad = {
        "model_nme": "x",
        "enabled": False,
        "precision": "fp8",
        "batch_size": 0,
        "logprob_batch_sise": 4,
        "max_model_len": "long",
        "checkpoint_path": str(tmp_path / "missing.pt"),
        "tokenizer": {"nam": "x", "chat_template": str(tmp_path / "missing.jinja")},
        "resources": {"num_gpus": -1, "gpus": 1, "num_nodes": 2},
        "reward_model_cfg": {"reward_model_type": "regression"},
        "dynamic_batching": {"enabled": "yes", "logprob_mb_tokens": 8},
        "sequence_packing": {
            "algorithm": "first_fit_decreasng",
            "microbatch_order": "random",
            "sequence_length_pad_multiple": 8,
        },
    }
    with pytest.raises(ConfigError) as info:
        RewardModelEnvironment(bad)
    missing_template = str(tmp_path / "missing.jinja")
    assert info.value.problems == [
        "precision: 'fp8' is not one of float32, bfloat16, float16",
        "batch_size: must be >= 1, got 0",
        "max_model_len: expected int, got str ('long')",
        "resources.num_gpus: must be >= 0, got -1",
        "resources.gpus: unknown option. Did you mean 'num_gpus'?",
        "reward_model_cfg.reward_model_type: 'regression' is not one of bradley_terry",
        "dynamic_batching.enabled: expected bool, got str ('yes')",
        "sequence_packing.microbatch_order: 'random' is not one of packer, largest_first",
        "sequence_packing.sequence_length_pad_multiple: unknown option. "
        "Did you mean 'sequence_length_round'?",
        "model_nme: unknown option. Did you mean 'model_name'?",
        "logprob_batch_sise: unknown option. Did you mean 'logprob_batch_size'?",
        "tokenizer.nam: unknown option. Did you mean 'name'?",
        "enabled: False is invalid; this config disables the environment; don't create it",
        f"tokenizer.chat_template: {missing_template!r} is invalid; no such .jinja file",
        f"checkpoint_path: {str(tmp_path / 'missing.pt')!r} is invalid; no such file",
        "resources.num_nodes: 2 is invalid; the environment is one Ray actor on one node: use 1 "
        "(start several environments to use more nodes)",
        "sequence_packing.algorithm: 'first_fit_decreasng' is invalid; use one of concatenative, "
        "first_fit_decreasing, first_fit_shuffle, modified_first_fit_decreasing; did you mean "
        "'first_fit_decreasing'?",
    ]
    with pytest.raises(ConfigError) as info:
        validate_config({"max_model_len": 200, "dynamic_batching": {"sequence_length_round": 128}}
                        | {"sequence_packing": {"enabled": True, "logprob_mb_tokens": 250,
                                                "sequence_length_round": 64}})  # fmt: skip
    assert info.value.problems == [
        "sequence_packing.logprob_mb_tokens: 250 is invalid; raise it to at least 256 "
        "(max_model_len 200 rounded up to sequence_length_round 64), so every conversation fits"
    ]
    with pytest.raises(ConfigError) as info:
        validate_config("model")
    assert info.value.problems == ["expected a mapping, got str ('model')"]


def test_aliases_resolve_and_conflicts_are_errors():
    assert validate_config({"logprob_batch_size": 8})["batch_size"] == 8
    assert validate_config({"logprob_batch_size": 8, "batch_size": 8})["batch_size"] == 8
    with pytest.warns(FutureWarning, match="max_tokens_per_batch is deprecated; rename it"):
        dynamic = validate_config({"dynamic_batching": {"max_tokens_per_batch": 9000}})
    assert dynamic["dynamic_batching"] == {
        "enabled": True,
        "logprob_mb_tokens": 9000,
        "sequence_length_round": 1,
    }
    packing = validate_config({"sequence_packing": {"enabled": True}})
    assert packing["dynamic_batching"]["enabled"] is False  # packing replaces the default
    conflicts = {
        "batch_size": 8,
        "logprob_batch_size": 4,
        "resources": {"num_gpus": 1, "gpus_per_node": 2},
        "dynamic_batching": {"enabled": True, "max_tokens_per_batch": 5000,
                             "logprob_mb_tokens": 6000},
        "sequence_packing": {"enabled": True},
    }  # fmt: skip
    with pytest.raises(ConfigError) as info, pytest.warns(FutureWarning):
        validate_config(conflicts)
    assert info.value.problems == [
        "logprob_batch_size: 4 conflicts with batch_size 8; they name one setting here, "
        "give only one of them",
        "resources.gpus_per_node: 2 conflicts with resources.num_gpus 1; they name one setting "
        "here, give only one of them",
        "dynamic_batching.max_tokens_per_batch: 5000 conflicts with "
        "dynamic_batching.logprob_mb_tokens 6000; they name one setting here, give only one "
        "of them",
        "sequence_packing.enabled: True conflicts with dynamic_batching.enabled: True; "
        "enable one of them",
    ]
    with pytest.raises(ConfigError, match="reward_model_cfg.enabled: False is invalid"):
        validate_config({"reward_model_cfg": {"enabled": False}})
    # A key its declaration rejects is not checked against the others as well.
    too_small = {"logprob_mb_tokens": 256, "sequence_length_round": 0}  # 256 < max_model_len
    with pytest.raises(ConfigError) as info:
        validate_config({"batch_size": 8, "logprob_batch_size": 0, "dynamic_batching": too_small})
    assert info.value.problems == [
        "logprob_batch_size: must be >= 1, got 0",
        "dynamic_batching.sequence_length_round: must be >= 1, got 0",
    ]


def test_none_means_defaults_and_ray_options_come_from_resources():
    assert validate_config(None) == DEFAULTS
    assert DEFAULTS == {
        "enabled": True,
        "model_name": "Skywork/Skywork-Reward-V2-Qwen3-0.6B",
        "tokenizer": None,
        "precision": "bfloat16",
        "batch_size": 32,
        "checkpoint_path": None,
        "max_model_len": 4096,
        "max_parse_chars": 1_000_000,
        "resources": {"num_cpus": 1, "num_gpus": 0},
        "reward_model_cfg": {"enabled": True, "reward_model_type": "bradley_terry"},
        "dynamic_batching": {"enabled": True, "logprob_mb_tokens": 32768,
                             "sequence_length_round": 1},
        "sequence_packing": {"enabled": False, "logprob_mb_tokens": 8192,
                             "algorithm": "modified_first_fit_decreasing",
                             "sequence_length_round": 1, "microbatch_order": "packer"},
    }  # fmt: skip
    assert reward_model_ray_options(None) == {"num_cpus": 1, "num_gpus": 0}
    assert reward_model_ray_options({"resources": {"num_cpus": 2, "num_gpus": 0.5}}) == {
        "num_cpus": 2,
        "num_gpus": 0.5,
    }


def test_check_env_in_process(rm_dir):
    env = make_env(rm_dir, logprob_mb_tokens=512)
    ret = check_env(env, LOGS, [None] * len(LOGS))
    assert ret.terminateds.all()
    empty = env.step([], [])
    assert empty.rewards.shape == (0,) and empty.observations == [] and empty.answers == []


@pytest.mark.ray
def test_check_env_as_a_ray_actor(rm_dir, ray_session):
    cfg = {"model_name": str(rm_dir), "precision": "float32", "resources": {"num_cpus": 1}}
    actor_cls = ray_session.remote(RewardModelEnvironment)
    actor = actor_cls.options(**reward_model_ray_options(cfg)).remote(cfg)
    try:
        ret = check_env(actor, LOGS, [None] * len(LOGS))
        local = make_env(rm_dir, logprob_mb_tokens=512).step(LOGS, [None] * len(LOGS))
        assert (ret.rewards - local.rewards).abs().max().item() < 1e-5
    finally:
        ray_session.get(actor.shutdown.remote())
        ray_session.kill(actor)


# --- NeMo-RL config parity --------------------------------------------------------------


def nemo_basic_env_config(model: str) -> dict:
    """NeMo-RL's ``basic_env_config`` (tests/unit/environments/test_reward_model_environment.py)
    with the tiny local reward model instead of the hub one, in float32."""
    return {
        "enabled": True,
        "model_name": model,
        "tokenizer": {"name": model},
        "precision": "float32",
        "offload_optimizer_for_logprob": False,
        "batch_size": 32,
        "checkpoint_path": None,
        "max_model_len": 1024,
        "resources": {"gpus_per_node": 1, "num_nodes": 1},
        "reward_model_cfg": {"enabled": True, "reward_model_type": "bradley_terry"},
        "dtensor_cfg": {
            "_v2": True,
            "enabled": True,
            "cpu_offload": False,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "custom_parallel_plan": None,
        },
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": False},
        "max_grad_norm": None,
    }


def published_block(model: str, **overrides) -> dict:
    """Every key of the published reward-model environment blocks (examples/configs/
    grpo_rm_1B.yaml, the test's basic_env_config, RewardModelEnvironmentConfig's fields), the
    sub-keys of NeMo-RL's TokenizerConfig that shape the text, and of its
    DynamicBatchingConfig / SequencePackingConfig as the policy configs publish them."""
    block = {
        **nemo_basic_env_config(model),
        "processor": "math_hf_data_processor",
        "tokenizer": {"name": model, "chat_template": "default", "chat_template_kwargs": None},
        "batch_size": 4,
        "logprob_batch_size": 4,
        "max_model_len": 512,
        "dynamic_batching": {
            "enabled": True,
            "train_mb_tokens": 4096,
            "logprob_mb_tokens": 1024,
            "sequence_length_round": 64,
        },
        "sequence_packing": {
            "enabled": False,
            "train_mb_tokens": 4096,
            "logprob_mb_tokens": 1024,
            "algorithm": "modified_first_fit_decreasing",
            "microbatch_order": "packer",
            "sequence_length_round": 64,
        },
        "generation": {
            "backend": "vllm",
            "max_new_tokens": 512,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": None,
            "stop_token_ids": None,
            "stop_strings": None,
            "vllm_cfg": {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.6},
        },
    }
    return {**block, **overrides}


def construct(config: dict) -> tuple[RewardModelEnvironment, list[str]]:
    """The environment and the messages of the UnusedConfigWarnings its construction gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = RewardModelEnvironment(config)
    return env, [str(w.message) for w in caught if issubclass(w.category, UnusedConfigWarning)]


def unused_message(keys: str) -> str:
    return (
        f"reward_model: {keys} configure NeMo-RL's trainer or data pipeline and do not affect "
        "scoring; the environment does not use them."
    )


def forward_shapes(module: torch.nn.Module) -> list[tuple[int, ...]]:
    """A list that fills with the ``input_ids`` shape of every forward pass of ``module``."""
    shapes: list[tuple[int, ...]] = []
    module.register_forward_pre_hook(
        lambda _m, _args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    return shapes


LONGER_LOGS = [conversation(i) for i in (11, 0, 3, 12, 1, 6, 2, 9, 4, 10)]


def test_published_basic_env_config_constructs_and_scores(rm_dir):
    config = nemo_basic_env_config(str(rm_dir))
    env, messages = construct(config)
    assert messages == [unused_message("offload_optimizer_for_logprob, max_grad_norm, dtensor_cfg")]
    assert reward_model_ray_options(config) == {"num_cpus": 1, "num_gpus": 1}
    minimal = make_env(rm_dir).step(LOGS, [None] * len(LOGS)).rewards
    assert (env.step(LOGS, [None] * len(LOGS)).rewards - minimal).abs().max().item() < 1e-5
    assert env.preprocess_data(LOGS[:2])["input_lengths"].tolist() == (
        make_env(rm_dir).preprocess_data(LOGS[:2])["input_lengths"].tolist()
    )


def test_every_published_key_constructs_scores_and_warns_once(rm_dir):
    env, messages = construct(published_block(str(rm_dir)))
    assert messages == [
        unused_message(
            "processor, offload_optimizer_for_logprob, max_grad_norm, dtensor_cfg, generation, "
            "dynamic_batching.train_mb_tokens, sequence_packing.train_mb_tokens"
        )
    ]
    shapes = forward_shapes(env.model)
    rewards = env.step(LONGER_LOGS, [None] * 10).rewards
    fixed = make_env(rm_dir, batch_size=4).step(LONGER_LOGS, [None] * 10).rewards
    assert (rewards - fixed).abs().max().item() < 1e-5
    # Length-sorted batches of at most 4 rows, padded to a multiple of 64, <= 1024 tokens.
    assert sum(rows for rows, _ in shapes) == 10
    assert all(rows <= 4 and width % 64 == 0 and rows * width <= 1024 for rows, width in shapes)
    assert max(rows for rows, _ in shapes) > 1
    # `envloop run` checks env configs against the TypedDict before starting actors.
    assert env_config_problems(RewardModelEnvironment, published_block("m"), "envs.rm") == []
    assert unused_keys({"model_name": "m", "dynamic_batching": {"enabled": False}}) == []
    _, quiet = construct({"model_name": str(rm_dir), "precision": "float32"})
    assert quiet == []


def test_dynamic_batching_uses_logprob_mb_tokens_and_sequence_length_round(rm_dir):
    lengths = make_env(rm_dir).preprocess_data(LONGER_LOGS)["input_lengths"].tolist()
    budget = 3 * round_up(max(lengths), 32)
    dynamic = {"enabled": True, "logprob_mb_tokens": budget, "sequence_length_round": 32}
    env = RewardModelEnvironment(
        {"model_name": str(rm_dir), "precision": "float32", "max_model_len": max(lengths),
         "batch_size": 8, "dynamic_batching": dynamic}
    )  # fmt: skip
    plan = env.scoring_plan(lengths)
    assert plan == plan_batches(lengths, 8, budget, round_to=32)
    assert sorted(i for batch in plan for i in batch) == list(range(10))
    assert all(len(b) * round_up(max(lengths[i] for i in b), 32) <= budget for b in plan)
    assert len(plan) < 10  # some batches hold several conversations
    shapes = forward_shapes(env.model)
    rewards = env.step(LONGER_LOGS, [None] * 10).rewards
    assert shapes == [(len(b), round_up(max(lengths[i] for i in b), 32)) for b in plan]
    fixed = make_env(rm_dir, batch_size=1).step(LONGER_LOGS, [None] * 10).rewards
    assert (rewards - fixed).abs().max().item() < 1e-5


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
@pytest.mark.parametrize("order", ["packer", "largest_first"])
def test_sequence_packing_gives_the_unpacked_scores(rm_dir, algorithm, order):
    lengths = make_env(rm_dir).preprocess_data(LONGER_LOGS)["input_lengths"].tolist()
    budget = round_up(2 * max(lengths), 16)
    packing = {
        "enabled": True,
        "logprob_mb_tokens": budget,
        "algorithm": algorithm,
        "sequence_length_round": 16,
        "microbatch_order": order,
        "train_mb_tokens": 1,
    }
    env, messages = construct(
        {"model_name": str(rm_dir), "precision": "float32", "max_model_len": max(lengths),
         "sequence_packing": packing}
    )  # fmt: skip
    assert messages == [unused_message("sequence_packing.train_mb_tokens")]
    random.seed(0)  # first_fit_shuffle draws from the global random state
    plan = env.scoring_plan(lengths)
    totals = [sum(lengths[i] for i in row) for row in plan]
    assert sorted(i for row in plan for i in row) == list(range(10))
    assert all(round_up(total, 16) <= budget for total in totals)
    assert len(plan) < 10  # conversations really share rows
    if order == "largest_first":
        assert totals == sorted(totals, reverse=True)
    shapes = forward_shapes(env.model.base_model)
    random.seed(0)
    packed = env.step(LONGER_LOGS, [None] * 10).rewards
    assert shapes == [(1, round_up(total, 16)) for total in totals]
    unpacked = make_env(rm_dir, batch_size=1).step(LONGER_LOGS, [None] * 10).rewards
    assert (packed - unpacked).abs().max().item() < 1e-5
    assert unpacked.std() > 0.05


def test_packed_rows_are_exact_with_eager_attention_too(rm_dir):
    model = AutoModelForSequenceClassification.from_pretrained(
        rm_dir, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    sequences = [
        tokenizer(tokenizer.apply_chat_template(log, tokenize=False))["input_ids"] for log in LOGS
    ]
    assert packing_problem(model) is None
    pad = tokenizer.pad_token_id
    packed = score_packed(model, sequences, [[0, 1, 2], [3, 4], [5, 6]], pad, round_to=8)
    alone = score_sequences(model, sequences, [[i] for i in range(len(LOGS))], pad)
    assert (packed - alone).abs().max().item() < 1e-5
    # Without the block-diagonal mask the packed scores would differ (the mask matters).
    ids = torch.tensor([[t for s in sequences[:3] for t in s]])
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    ends = torch.tensor([len(s) for s in sequences[:3]]).cumsum(0) - 1
    leaked = model.score(hidden[ends])[:, 0]
    assert (leaked[1:] - alone[1:3]).abs().min().item() > 0.01


def test_packing_is_refused_for_models_it_cannot_score_exactly(rm_dir, monkeypatch):
    flash = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash"))
    assert packing_problem(flash) == (
        "its attention implementation 'flash' ignores custom 4-D masks (packing needs one of "
        "eager, sdpa)"
    )
    monkeypatch.setattr(reward_model_environment, "packing_problem", lambda model: "a reason")
    with pytest.raises(ValueError, match="cannot score packed rows exactly: a reason. Set "):
        make_env(rm_dir, sequence_packing={"enabled": True, "logprob_mb_tokens": 512})


def test_tokenizer_chat_template_options(rm_dir, tmp_path):
    log = LOGS[1]
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)

    def ids_of(tokenizer_options):
        env = make_env(rm_dir, tokenizer={"name": str(rm_dir), **tokenizer_options})
        return env.preprocess_data([log])["input_ids"][0].tolist()

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    contents = "".join(m["content"] for m in log)
    assert ids_of({"chat_template": None}) == tokens(contents)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rendered = "".join(f"[{m['role']}] {m['content']}\n" for m in log)
    assert ids_of({"chat_template": template}) == tokens(rendered)
    (tmp_path / "t.jinja").write_text(template)
    assert ids_of({"chat_template": str(tmp_path / "t.jinja")}) == tokens(rendered)
    assert (
        ids_of({"chat_template": "default"})
        == ids_of({})
        == tokens(tokenizer.apply_chat_template(log, tokenize=False))
    )
    kwargs = {"chat_template": "{{ prefix }}" + template, "chat_template_kwargs": {"prefix": "Q:"}}
    assert ids_of(kwargs) == tokens("Q:" + rendered)
    env = make_env(rm_dir, tokenizer={"name": str(rm_dir), "chat_template": None})
    with torch.no_grad():
        expected = env.model(input_ids=torch.tensor([tokens(contents)])).logits[0, 0].item()
    assert env.step([log], [None]).rewards[0].item() == pytest.approx(expected, abs=1e-5)


# env.reward_model of NeMo-RL's examples/configs/grpo_rm_1B.yaml; only the model (MODEL), the
# precision (bfloat16) and batch_size (${policy.train_micro_batch_size}) are replaced.
GRPO_RM_1B_BLOCK = """
processor: "math_hf_data_processor"
model_name: MODEL
tokenizer:
  name: MODEL
precision: "float32"
batch_size: 4
checkpoint_path: null
max_model_len: 2048
offload_optimizer_for_logprob: false
resources:
  gpus_per_node: 1
  num_nodes: 1
dtensor_cfg:
  _v2: true
  enabled: true
  sequence_parallel: false
  tensor_parallel_size: 1
  context_parallel_size: 1
  custom_parallel_plan: null
  cpu_offload: false
  activation_checkpointing: false
reward_model_cfg:
  enabled: true
  reward_model_type: "bradley_terry"
dynamic_batching:
  enabled: false
sequence_packing:
  enabled: false
max_grad_norm: null
"""


def test_the_published_grpo_yaml_block_constructs_and_scores(rm_dir):
    config = yaml.safe_load(GRPO_RM_1B_BLOCK.replace("MODEL", str(rm_dir)))
    env, messages = construct(config)
    assert messages == [
        unused_message("processor, offload_optimizer_for_logprob, max_grad_norm, dtensor_cfg")
    ]
    assert env.scoring_plan([5, 9, 7, 3, 8]) == [[0, 1, 2, 3], [4]]  # fixed batches of 4
    minimal = make_env(rm_dir).step(LOGS, [None] * len(LOGS)).rewards
    assert (env.step(LOGS, [None] * len(LOGS)).rewards - minimal).abs().max().item() < 1e-5
