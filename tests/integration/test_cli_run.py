"""``envloop run`` end to end on a tiny policy: math and sliding-puzzle environments as Ray
actors, every output file checked, then ``envloop report`` and ``envloop reverify``; and
``rollout.mode: async`` writing what a sync run writes, with progress per finished sample."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from envloop.cli.main import main
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.environments.games.sliding_puzzle import initial_prompt, new_episode_metadata
from envloop.run.outputs import read_rollouts

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MATH = [("What is 2 + 3?", "5"), ("What is 4 * 2?", "8"), ("What is 9 - 1?", "8")]
NUM_SAMPLES = (len(MATH) + 2) * 2  # two generations per prompt


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_policy_dir, ray_session):
    folder = tmp_path_factory.mktemp("cli_run")
    rows = [{"prompt": q, "ground_truth": a, "task": "math"} for q, a in MATH]
    for seed in range(2):
        episode = new_episode_metadata(seed, size=2, shuffle_moves=3, max_moves=4)
        rows.append({"prompt": initial_prompt(episode), "task": "puzzle", "metadata": episode})
    (folder / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = {
        "policy": {"model_name": str(tiny_policy_dir), "max_new_tokens": 12, "seed": 3},
        "data": {"path": "prompts.jsonl", "columns": {"metadata": "metadata"}},
        "envs": {
            "math": {"name": "math", "config": {"num_workers": 1}},
            "puzzle": {"name": "sliding_puzzle", "stop_strings": ["</action>"]},
        },
        "rollout": {"max_seq_len": 420, "max_turns": 4, "generations_per_prompt": 2,
                    "batch_size": 4},
        "output": {"dir": str(folder / "run")},
    }  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    return folder


@pytest.fixture(scope="module")
def run_output(run_dir):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["run", str(run_dir / "run.yaml"), "rollout.max_turns=2", "--quiet"])
    return status, out.getvalue(), run_dir / "run"


@pytest.fixture(scope="module")
def tokenizer(tiny_policy_dir):
    return AutoTokenizer.from_pretrained(tiny_policy_dir)


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_prints_progress_and_a_summary(run_output):
    status, out, run = run_output
    assert status == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("5 prompts from ") and lines[0].endswith("tasks: math, puzzle")
    progress = [line for line in lines if line.startswith("progress: ")]
    assert [p.split(" samples")[0] for p in progress] == [
        "progress: 4/10", "progress: 8/10", "progress: 10/10",
    ]  # fmt: skip
    records = jsonl(run / "rollouts.jsonl")
    header = lines.index("task    samples  mean reward  mean turns")
    for offset, task in enumerate(["math", "puzzle"], start=1):
        mine = [r for r in records if r["task"] == task]
        mean = sum(r["total_reward"] for r in mine) / len(mine)
        turns = sum(r["num_turns"] for r in mine) / len(mine)
        assert lines[header + offset] == f"{task:<6}  {len(mine):>7}  {mean:>11.3f}  {turns:>10.2f}"
    assert lines[header + 3].startswith("total        10")
    assert f"run directory: {run}" in lines and f"report: {run / 'report.html'}" in lines


def test_config_and_metrics_files(run_output):
    _, _, run = run_output
    assert sorted(p.name for p in run.iterdir()) == [
        "config.yaml", "metrics.json", "report.html", "rollouts.jsonl", "rollouts.parquet",
    ]  # fmt: skip
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["rollout"]["max_turns"] == 2  # the override
    assert config["policy"]["temperature"] == 1.0 and config["ray"]["num_cpus"] == 2  # defaults
    assert config["data"]["path"].endswith("prompts.jsonl")
    metrics = json.loads((run / "metrics.json").read_text())
    records = jsonl(run / "rollouts.jsonl")
    assert metrics["rollout"]["total_turns"] == sum(r["num_turns"] for r in records)
    assert metrics["rollout"]["max_turns_per_sample"] <= 2
    assert metrics["envs"]["math"]["math_env/num_samples"] == 6
    assert metrics["envs"]["puzzle"]["sliding_puzzle_env/num_episodes"] == 4
    assert {task: m["num_samples"] for task, m in metrics["per_task"].items()} == {
        "math": 6, "puzzle": 4,
    }  # fmt: skip
    assert metrics["wall_time_s"] > 0


def test_jsonl_records(run_output):
    _, _, run = run_output
    records = jsonl(run / "rollouts.jsonl")
    assert [r["sample"] for r in records] == list(range(NUM_SAMPLES))
    assert [(r["idx"], r["generation"]) for r in records] == [(i // 2, i % 2) for i in range(10)]
    for record in records:
        assert record["total_reward"] == pytest.approx(sum(record["turn_rewards"]))
        assert len(record["turn_rewards"]) == record["num_turns"]
        roles = [m["role"] for m in record["messages"]]
        assert roles[0] == "user" and roles.count("assistant") == record["num_turns"]
        observed = [m["reward"] for m in record["messages"] if "reward" in m]
        assert observed == record["turn_rewards"][: len(observed)]
        assert record["error"] is None and record["loss_multiplier"] == 1.0
    math = [r for r in records if r["task"] == "math"]
    assert [r["messages"][0]["content"] for r in math[::2]] == [q for q, _ in MATH]
    assert all(r["ground_truth"] == r["extra_env_info"]["ground_truth"] for r in math)
    assert all(r["messages"][2]["content"].startswith("Environment: ") for r in math)
    puzzles = [r for r in records if r["task"] == "puzzle"]
    assert all(r["initial_extra_env_info"]["moves_made"] == 0 for r in puzzles)
    assert all(r["extra_env_info"]["moves_made"] == r["num_turns"] for r in puzzles)


def test_parquet_is_token_exact_against_the_jsonl(run_output, tokenizer):
    _, _, run = run_output
    records = jsonl(run / "rollouts.jsonl")
    table = pq.read_table(run / "rollouts.parquet")
    assert table.schema.field("input_ids").type.value_type.bit_width == 64
    rows = table.to_pylist()
    assert len(rows) == len(records)
    for record, row in zip(records, rows):
        assert [(m["role"], m["content"], m["num_tokens"]) for m in row["messages"]] == [
            (m["role"], m["content"], m["num_tokens"]) for m in record["messages"]
        ]
        ids, counts = row["input_ids"], row["message_token_counts"]
        assert counts == [m["num_tokens"] for m in record["messages"]]
        assert sum(counts) == len(ids) == len(row["loss_mask"]) == len(row["generation_logprobs"])
        prompt = [m for m in record["messages"] if m["role"] != "assistant"][:1]
        fresh = get_formatted_message_log(prompt, tokenizer, add_generation_prompt=True)
        prompt_ids = [t for m in fresh for t in m["token_ids"].tolist()]
        assert ids[: len(prompt_ids)] == prompt_ids
        start = 0
        for message, n in zip(record["messages"], counts):
            piece = slice(start, start + n)
            generated = message["role"] == "assistant"
            assert row["loss_mask"][piece] == [int(generated)] * n
            if generated:
                text = tokenizer.decode(ids[piece])
                assert text in (message["content"], message["content"] + tokenizer.eos_token)
                assert all(lp <= 0 for lp in row["generation_logprobs"][piece])
            else:
                assert row["generation_logprobs"][piece] == [0.0] * n
                assert message["content"] in tokenizer.decode(ids[piece])
            start += n
        assert any(lp < 0 for lp in row["generation_logprobs"])
        assert row["generation_policy_versions"] == [0] * len(ids)  # no update in a run
        assert row["min_policy_version"] == row["max_policy_version"] == 0
    assert [
        {k: v for k, v in r.items() if k not in ("input_ids", "generation_logprobs", "loss_mask",
                                                  "message_token_counts",
                                                  "generation_policy_versions")}
        for r in read_rollouts(run)
    ] == records  # fmt: skip


def test_report_and_reverify(run_output, capsys):
    _, _, run = run_output
    (run / "report.html").unlink()
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"report: {run / 'report.html'}"
    assert (run / "report.html").read_text().lstrip().lower().startswith("<!doctype html")
    assert main(["reverify", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Re-verified {NUM_SAMPLES} samples of ")
    assert ": 0 changed" in out


class Terminal(io.StringIO):
    """Standard output as a terminal: the live progress line."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def greedy_runs(run_dir):
    """The config of ``run_dir`` with greedy decoding, in sync mode (log lines) and in async
    mode with at most 3 samples in flight (on a terminal): mode -> (stdout, run directory)."""
    runs = {}
    for mode, out, options in [
        ("sync", io.StringIO(), ["--quiet"]),
        ("async", Terminal(), ["rollout.mode=async", "rollout.max_concurrent_samples=3"]),
    ]:
        args = ["run", str(run_dir / "run.yaml"), "rollout.max_turns=2", "rollout.greedy=true",
                f"output.dir={run_dir / mode}", *options]  # fmt: skip
        with contextlib.redirect_stdout(out):
            status = main(args)
        assert status == 0, out.getvalue()
        runs[mode] = (out.getvalue(), run_dir / mode)
    return runs


TIMING_METRICS = re.compile(r"^timing/|_time_s$|_per_s$|^wall_time_s$")


def test_async_run_writes_what_a_sync_run_writes(greedy_runs):
    (sync_out, sync), (async_out, asynchronous) = greedy_runs["sync"], greedy_runs["async"]
    assert sorted(p.name for p in asynchronous.iterdir()) == sorted(p.name for p in sync.iterdir())
    assert jsonl(asynchronous / "rollouts.jsonl") == jsonl(sync / "rollouts.jsonl")
    sync_rows = pq.read_table(sync / "rollouts.parquet").to_pylist()
    async_rows = pq.read_table(asynchronous / "rollouts.parquet").to_pylist()
    assert [r["sample"] for r in async_rows] == list(range(NUM_SAMPLES))
    for mine, theirs in zip(async_rows, sync_rows, strict=True):
        logprobs = mine.pop("generation_logprobs")
        assert logprobs == pytest.approx(theirs.pop("generation_logprobs"), abs=1e-4)
        assert mine == theirs  # input_ids, loss_mask, messages, rewards, ...
    configs = [yaml.safe_load((run / "config.yaml").read_text()) for run in (asynchronous, sync)]
    assert configs[0]["rollout"]["mode"] == "async" and configs[1]["rollout"]["mode"] == "sync"
    assert configs[0]["rollout"]["max_concurrent_samples"] == 3
    for config in configs:
        del config["rollout"]["mode"], config["rollout"]["max_concurrent_samples"]
        del config["output"]["dir"]
    assert configs[0] == configs[1]
    metrics = [json.loads((run / "metrics.json").read_text()) for run in (asynchronous, sync)]
    assert [list(m) for m in metrics[0].values() if isinstance(m, dict)] == [
        list(m) for m in metrics[1].values() if isinstance(m, dict)
    ]
    for m in metrics:
        m["rollout"] = {k: v for k, v in m["rollout"].items() if not TIMING_METRICS.search(k)}
        del m["startup"], m["wall_time_s"]
    assert metrics[0] == metrics[1]
    summary = [line for line in sync_out.splitlines() if not line.startswith("progress")]
    assert async_out.split("\x1b[K\n", 1)[1].splitlines()[:4] == summary[1:5]  # the table


def test_async_run_draws_progress_per_finished_sample(greedy_runs):
    out, _ = greedy_runs["async"]
    draws = out.split("\x1b[K\n")[0].split("\r")[1:]
    done = [int(re.search(r"\] (\d+)/10 samples", d)[1]) for d in draws]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 10
    assert set(range(NUM_SAMPLES + 1)) <= set(done)  # every finished sample drawn
    for draw, count in zip(draws, done):
        # the mean reward per task counts every finished sample, as it finishes
        per_task = [int(n) for n in re.findall(r"\((\d+)\)", draw.split("mean reward: ")[1])]
        assert sum(per_task) == count
