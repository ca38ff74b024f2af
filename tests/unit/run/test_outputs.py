"""Run directory files: records of a real rollout, JSONL and Parquet written and read back."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from envloop.data.datasets import PromptSample, build_rollout_batch
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from envloop.run.outputs import RunWriter, read_rollouts
from envloop.run.records import TOKEN_KEYS, jsonable, sample_records
from tests.fixtures.envs import ComponentRewardEnv, EchoEnv, FailingEnv

SAMPLES = [
    PromptSample(7, "echo", [{"role": "system", "content": "Be nice."},
                             {"role": "user", "content": "Say hi."}], None, {"reply": "again"}),
    PromptSample(8, "scored", [{"role": "user", "content": "Score me."}], "42",
                 {"ground_truth": "42"}),
    PromptSample(9, "fail", [{"role": "user", "content": "Fail."}], None, {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def records(tiny_tokenizer):
    batch = build_rollout_batch(SAMPLES, tiny_tokenizer, generations_per_prompt=1)
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "hello there", logprob=-0.5)
    envs = {"echo": EchoEnv(), "scored": ComponentRewardEnv(), "fail": FailingEnv()}
    final, _ = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, envs, max_seq_len=200, max_rollout_turns=2,
        observation_format="chat_template",
    )  # fmt: skip
    return sample_records(final, first_sample=10)


def test_records_hold_original_messages_and_turn_rewards(records):
    echo, scored, failed = records
    assert [r["sample"] for r in records] == [10, 11, 12]
    assert [(r["idx"], r["task"], r["generation"]) for r in records] == [
        (7, "echo", 0), (8, "scored", 0), (9, "fail", 0),
    ]  # fmt: skip
    assert [(m["role"], m["content"], m.get("reward")) for m in echo["messages"]] == [
        ("system", "Be nice.", None), ("user", "Say hi.", None), ("assistant", "hello there", None),
        ("environment", "again", 0.5), ("assistant", "hello there", None),
        ("environment", "again", 0.5),
    ]  # fmt: skip
    assert (echo["total_reward"], echo["turn_rewards"], echo["num_turns"]) == (1.0, [0.5, 0.5], 2)
    assert (echo["terminated"], echo["truncated"], echo["error"]) == (False, False, None)
    # Components are batch columns, but a record keeps only its own environment's.
    assert echo["rewards"] == {}
    assert echo["extra_env_info"] == {"reply": "again"}
    length = float(torch.tensor(len("hello there") / 100))
    assert scored["rewards"] == {"reward/format": 0.25, "reward/length": length}
    assert scored["messages"][-1]["reward"] == scored["total_reward"] == scored["turn_rewards"][0]
    assert scored["ground_truth"] == "42" and scored["initial_extra_env_info"] == {
        "ground_truth": "42"
    }
    assert [m["role"] for m in failed["messages"]] == ["user", "assistant"]
    assert "boom: the failing environment always raises" in failed["error"]
    assert (failed["loss_multiplier"], failed["turn_rewards"]) == (0.0, [0.0])


def test_token_columns_are_aligned(records, tiny_tokenizer):
    for record in records:
        ids, counts = record["input_ids"], record["message_token_counts"]
        assert counts == [m["num_tokens"] for m in record["messages"]]
        assert sum(counts) == len(ids) == len(record["loss_mask"])
        assert len(record["generation_logprobs"]) == len(ids)
        start = 0
        for message, n in zip(record["messages"], counts):
            generated = message["role"] == "assistant"
            assert record["loss_mask"][start : start + n] == [int(generated)] * n
            assert (
                record["generation_logprobs"][start : start + n] == [-0.5 if generated else 0.0] * n
            )
            if generated:
                text = tiny_tokenizer.decode(ids[start : start + n])
                assert text == message["content"] + tiny_tokenizer.eos_token
            start += n


def test_writer_and_readers_round_trip(records, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.html").write_text("stale")
    with RunWriter(run_dir) as writer:
        writer.write_config({"rollout": {"max_turns": 2}, "policy": {"model": "m"}})
        writer.add(records[:2])
        writer.add([])
        writer.add(records[2:])
        writer.write_metrics({"rollout": {"x": torch.tensor(1.5), "nan": float("nan")}})
    assert not (run_dir / "report.html").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text()) == {
        "rollout": {"max_turns": 2}, "policy": {"model": "m"},
    }  # fmt: skip
    assert list(yaml.safe_load((run_dir / "config.yaml").read_text())) == ["rollout", "policy"]
    assert json.loads((run_dir / "metrics.json").read_text()) == {
        "rollout": {"x": 1.5, "nan": None}
    }
    lines = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    without_tokens = [{k: v for k, v in r.items() if k not in TOKEN_KEYS} for r in records]
    assert lines == without_tokens
    assert read_rollouts(run_dir) == records
    with pytest.raises(FileNotFoundError, match="is .* a run directory"):
        read_rollouts(tmp_path)


def test_jsonable():
    value = {"t": torch.tensor([1, 2]), 3: (1.0, float("inf")), "o": object, "s": {"a"}}
    assert jsonable(value) == {"t": [1, 2], "3": [1.0, None], "o": str(object), "s": ["a"]}
