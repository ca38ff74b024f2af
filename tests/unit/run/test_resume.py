"""What a resumed run may change: keys that change results refuse, with their values;
where the work runs does not; changed prompts refuse."""

from __future__ import annotations

import pytest
from PIL import Image

from envloop.config.errors import ConfigError
from envloop.data.datasets import PromptSample
from envloop.run.config import load_run_config
from envloop.run.records import jsonable
from envloop.run.resume import check_resumable, input_fingerprint, result_changes

BASE = ["policy.model_name=m", "data.path=d.jsonl", "envs.math.name=math"]


def resolved(*overrides):
    return jsonable(load_run_config(None, [*BASE, *overrides], deep=False).to_dict())


def test_result_changing_keys_are_named_with_both_values():
    old = resolved("policy.max_new_tokens=8")
    new = resolved("policy.max_new_tokens=16", "rollout.greedy=true", "envs.math.config={a: 1}")
    assert result_changes(old, new) == [
        'envs.math.config: null -> {"a": 1}',
        "policy.max_new_tokens: 8 -> 16",
        "rollout.greedy: false -> true",
    ]


def test_where_the_work_runs_changes_no_result():
    old = resolved()
    new = resolved("ray.address=ray://head:10001", "ray.num_cpus=8", "ray.log_to_driver=true",
                   "rollout.env_startup_timeout_s=30", "envs.math.num_cpus=2",
                   "output.dir=/elsewhere/run")  # fmt: skip
    assert result_changes(old, new) == []
    check_resumable("run", old, new, "same", "same")


def test_a_refusal_lists_every_change_and_the_fix():
    with pytest.raises(ConfigError) as caught:
        check_resumable("runs/a", resolved(), resolved("rollout.mode=async"), "one", "two")
    assert caught.value.problems[:2] == [
        'rollout.mode: "sync" -> "async"',
        "data: the prompts differ from those the run started with (data.path's rows, their "
        "selection or their tokenization changed)",
    ]
    assert "run without --resume to start over" in caught.value.problems[2]


def sample(image, text="hi"):
    content = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    return PromptSample(0, "t", [{"role": "user", "content": content}], None, {})


def test_the_fingerprint_follows_the_prompts_and_their_pixels():
    red = Image.new("RGB", (4, 4), (255, 0, 0))
    same = input_fingerprint([sample(red)], [[[1, 2]]])
    assert input_fingerprint([sample(red.copy())], [[[1, 2]]]) == same  # another object
    assert input_fingerprint([sample(Image.new("RGB", (4, 4), (0, 0, 255)))], [[[1, 2]]]) != same
    assert input_fingerprint([sample(red, "ho")], [[[1, 2]]]) != same
    assert input_fingerprint([sample(red)], [[[1, 3]]]) != same
