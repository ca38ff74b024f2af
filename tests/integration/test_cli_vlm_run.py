"""``envloop run`` with an image dataset end to end: a tiny Qwen2.5-VL policy, the ``vlm``
environment (four reward functions over two tasks) and a picture-showing environment as
Ray actors; the run directory's JSONL, Parquet and report carry the images."""

from __future__ import annotations

import contextlib
import io
import json

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

from envloop.cli.main import main
from envloop.environments.registry import register_env
from envloop.environments.rewards import bbox_giou, exact_alnum, format_reward
from envloop.models.processors import load_processor
from envloop.models.tiny_vlm import save_tiny_vlm
from envloop.run.outputs import read_rollouts
from tests.fixtures.images import noise_image

pytestmark = [pytest.mark.ray, pytest.mark.slow]

register_env("test_picture_board", "tests.fixtures.vlm_envs:PictureBoardEnv", overwrite=True)

ROWS = [
    {"prompt": "How many shapes?", "image": "imgs/a.png", "ground_truth": "3", "task": "count"},
    {"prompt": "Where is it?", "image": "imgs/b.png", "ground_truth": [0, 0, 28, 28],
     "task": "locate"},
    {"prompt": "What now?", "image": ["imgs/a.png", "imgs/c.png"], "task": "board",
     "metadata": {"turns": 2, "size": 28, "text": "And now?"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def run_output(tmp_path_factory, ray_session):
    folder = tmp_path_factory.mktemp("vlm_run")
    (folder / "imgs").mkdir()
    for name, (seed, size) in {"a": (0, (56, 56)), "b": (1, (84, 56)), "c": (2, (28, 28))}.items():
        noise_image(seed, size[1], size[0]).save(folder / "imgs" / f"{name}.png")
    (folder / "data.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    config = {
        "policy": {"model_name": str(save_tiny_vlm(folder / "vlm")), "max_new_tokens": 8},
        "data": {"path": "data.jsonl", "columns": {"images": "image", "metadata": "metadata"}},
        "envs": {
            "count": {"name": "vlm", "config": {"reward_functions": [
                {"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.5},
                {"name": "math_expr", "weight": 0.3}]}},
            "locate": {"name": "vlm", "config": {"reward_functions": [
                {"name": "format", "weight": 0.2}, {"name": "bbox_giou", "weight": 0.8}]}},
            "board": {"name": "test_picture_board", "requires_ground_truth": False},
        },
        "rollout": {"max_seq_len": 300, "max_turns": 3, "generations_per_prompt": 2,
                    "observation_format": "chat_template"},
        "output": {"dir": str(folder / "run")},
    }  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["run", str(folder / "run.yaml"), "--quiet"])
    return status, folder


def test_the_run_writes_images_and_scores_them(run_output):
    status, folder = run_output
    assert status == 0
    run = folder / "run"
    lines = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [line["task"] for line in lines] == ["count"] * 2 + ["locate"] * 2 + ["board"] * 2
    for line in lines:
        first = line["messages"][0]["content"]
        assert first[0]["type"] == "image" and first[0]["image"].startswith("images/")
        assert (run / first[0]["image"]).is_file()
        assert line["error"] is None
    # The vlm environment's reward is its weighted mix, recomputed here from the responses.
    for line in lines[:4]:
        response, truth = line["messages"][1]["content"], line["ground_truth"]
        fmt = format_reward([response], [truth])[0][0]
        if line["task"] == "count":
            expected = 0.2 * fmt + 0.5 * exact_alnum([response], [truth])[0][0]  # math: 0
        else:
            expected = 0.2 * fmt + 0.8 * bbox_giou([response], [truth])[0][0]
        assert line["total_reward"] == pytest.approx(expected)
    # The board shows a picture after each turn: two images in the prompt, two observed.
    board = [m for m in lines[4]["messages"] if isinstance(m["content"], list)]
    assert [sum(p["type"] == "image" for p in m["content"]) for m in board] == [2, 1, 1]


def test_the_parquet_rows_rebuild_the_rollouts_pixel_values(run_output):
    _, folder = run_output
    records = read_rollouts(folder / "run")
    processor = load_processor(str(folder / "vlm"))
    board = records[4]
    assert board["image_messages"] == [0, 0, 2, 4]
    images = [Image.open(io.BytesIO(data)) for data in board["images"]]
    rebuilt = processor.image_processor(images=images, return_tensors="pt")
    assert rebuilt["image_grid_thw"].tolist() == board["image_grid_thw"]
    image_token = processor.image_token_id
    placeholders = sum(int(token == image_token) for token in board["input_ids"])
    assert placeholders == int(torch.tensor(board["image_grid_thw"]).prod(-1).sum()) // 4
    table = pq.read_table(folder / "run" / "rollouts.parquet")
    assert "images" in table.column_names


def test_the_report_embeds_the_thumbnails(run_output):
    _, folder = run_output
    html = (folder / "run" / "report.html").read_text()
    assert html.count("data:image/") >= 3  # a.png, b.png, c.png and the board pictures
