"""Run directory files of rollouts whose messages hold images: JSON-safe image parts naming
PNG files written once each, and Parquet columns from which a trainer rebuilds the exact
vision inputs (tiny Qwen2.5-VL processor, real PIL images)."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from envloop.models.tiny_vlm import build_tiny_vlm_processor
from envloop.run.outputs import PARQUET_FILE, RunWriter, read_rollouts
from envloop.run.records import PARQUET_ONLY_KEYS, sample_records
from tests.unit.run.image_rollouts import (
    BLUE,
    QUESTION,
    RED,
    finished_sample,
    image_batch,
    image_prompt,
    png,
    rollout_batch,
)


def name_of(image: Image.Image) -> str:
    return f"images/{hashlib.sha256(png(image)).hexdigest()[:16]}.png"


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm_processor()


@pytest.fixture(scope="module")
def batch(processor):
    return image_batch(processor)


@pytest.fixture(scope="module")
def records(batch):
    return sample_records(batch)


@pytest.fixture(scope="module")
def run_dir(records, tmp_path_factory):
    run = tmp_path_factory.mktemp("image_run")
    with RunWriter(run) as writer:
        writer.add(records[:1])
        writer.add(records[1:])
    return run


def test_jsonl_image_parts_name_png_files_written_once(run_dir):
    lines = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    first, second, text_only = lines
    assert first["messages"][1]["content"] == [
        {"type": "image", "image": name_of(RED)}, {"type": "text", "text": QUESTION},
    ]  # fmt: skip
    assert first["messages"][3] == {
        "role": "environment",
        "content": [{"type": "text", "text": "Wrong. Look again:"},
                    {"type": "image", "image": name_of(BLUE)}],
        "num_tokens": first["messages"][3]["num_tokens"], "reward": 0.0,
    }  # fmt: skip
    assert [m["content"] for m in first["messages"][::2]] == ["Count carefully.", "two", "three"]
    # RED given as PNG bytes in the second prompt is the same file as the PIL image
    assert second["messages"][1]["content"][0] == {"type": "image", "image": name_of(RED)}
    assert text_only["messages"][0] == {"role": "user", "content": "Say hi.", "num_tokens": 16}
    assert not set(PARQUET_ONLY_KEYS) & (set(first) | set(text_only))
    text = (run_dir / "rollouts.jsonl").read_text()
    assert "pixel_values" not in text and "image_grid_thw" not in text
    files = sorted(p.name for p in (run_dir / "images").iterdir())
    assert files == sorted(name.split("/")[1] for name in (name_of(RED), name_of(BLUE)))
    for image in (RED, BLUE):  # lossless: the stored file has the pixels the processor saw
        stored = Image.open(run_dir / name_of(image))
        assert stored.mode == "RGB" and np.array_equal(np.asarray(stored), np.asarray(image))


def test_parquet_rebuilds_the_pixel_values_the_rollout_used(run_dir, batch, processor):
    rows = read_rollouts(run_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merge = processor.image_processor.merge_size
    for row, log in zip(rows[:2], batch["message_log"][:2]):
        used = [m for m in log if "pixel_values" in m]
        images = [Image.open(io.BytesIO(data)) for data in row["images"]]
        redone = processor.image_processor(images=images, return_tensors="pt")
        assert torch.equal(redone["pixel_values"], torch.cat([m["pixel_values"][0] for m in used]))
        grid = torch.cat([m["image_grid_thw"][0] for m in used])
        assert torch.equal(redone["image_grid_thw"], grid)
        assert row["image_grid_thw"] == grid.tolist()
        # each image's placeholder run, inside its own message, as long as its grid says
        ids = torch.tensor(row["input_ids"])
        bounds = np.cumsum([0, *row["message_token_counts"]])
        runs = []
        for j in row["image_messages"]:
            piece = ids[bounds[j] : bounds[j + 1]] == image_id
            runs.append(int(piece.sum()))
        assert runs == [int(g.prod()) // merge**2 for g in grid]
        assert int((ids == image_id).sum()) == sum(runs)
    assert rows[0]["image_messages"] == [1, 3] and rows[1]["image_messages"] == [1]
    assert rows[0]["image_grid_thw"] == [[1, 4, 6], [1, 4, 4]]


def test_parquet_reads_back_the_records(run_dir, records):
    assert read_rollouts(run_dir) == records
    table = pq.read_table(run_dir / PARQUET_FILE)
    messages = table.column("messages").to_pylist()
    user = messages[0][1]
    assert (user["content"], user["parts_json"]) == (
        QUESTION, json.dumps(records[0]["messages"][1]["content"]),
    )  # fmt: skip
    assert messages[2][0]["parts_json"] is None
    assert table.column("images").to_pylist() == [
        [png(RED), png(BLUE)], [png(RED)], [],
    ]  # fmt: skip
    assert table.column("image_grid_thw").to_pylist()[2] is None


def test_text_only_runs_write_no_images(records, tmp_path):
    text_only = records[2:]
    with RunWriter(tmp_path) as writer:
        writer.add(text_only)
    assert not (tmp_path / "images").exists()
    line = json.dumps({k: v for k, v in text_only[0].items() if k not in PARQUET_ONLY_KEYS})
    assert (tmp_path / "rollouts.jsonl").read_text() == line + "\n"
    assert read_rollouts(tmp_path) == text_only


def test_a_new_run_removes_the_images_of_an_earlier_one(run_dir, records, tmp_path):
    run = tmp_path / "run"
    with RunWriter(run) as writer:
        writer.add(records)
    (run / "images" / "notes.txt").write_text("mine")
    with RunWriter(run) as writer:
        writer.add(records[1:])
    assert sorted(p.name for p in (run / "images").iterdir()) == [
        name_of(RED).split("/")[1], "notes.txt",
    ]  # fmt: skip


def test_a_message_without_a_grid_row_per_image_stores_no_grid(processor):
    sample = finished_sample(processor, image_prompt(RED), [("three", None, 1.0)])
    del sample["message_log"][1]["image_grid_thw"]  # a processor that gives no grid
    [record] = sample_records(rollout_batch([sample], ["count"]))
    assert record["images"] == [png(RED)] and record["image_messages"] == [1]
    assert record["image_grid_thw"] is None


def test_an_unreadable_image_is_named(processor):
    sample = finished_sample(processor, image_prompt(RED), [("three", None, 1.0)])
    sample["prompt_messages"] = image_prompt(b"not an image")
    with pytest.raises(ValueError, match="sample 4, message 1, content part 0: the 12 bytes given"):
        sample_records(rollout_batch([sample], ["count"]), first_sample=4)
