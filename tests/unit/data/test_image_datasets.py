"""Image datasets (``data.columns.images``): every source, every image form, every bad image
named at once, rows in order; prompts tokenized by the processor, images shared across a
prompt's generations."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from envloop.config.errors import ConfigError
from envloop.data.dataset_config import ColumnsConfig, DataConfig
from envloop.data.datasets import build_rollout_batch, load_prompt_samples
from envloop.models.tiny_vlm import build_tiny_vlm_processor

TASKS = {"count": False}
COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}
SIZES = {"red": (28, 28), "green": (56, 28), "blue": (28, 42)}


def png(color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", SIZES[color], COLORS[color]).save(out, format="PNG")
    return out.getvalue()


def write_pngs(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for color in COLORS:
        (folder / f"{color}.png").write_bytes(png(color))
    return folder


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def config(path, **kwargs) -> DataConfig:
    return DataConfig(path=str(path), columns=ColumnsConfig(task=None, images="image"), **kwargs)


def described(messages):
    """Messages with each image part as ("image", size, its one colour)."""

    def part(p):
        if p.get("type") != "image":
            return p
        image = p["image"]
        assert isinstance(image, Image.Image) and image.mode == "RGB"
        [(_, color)] = image.getcolors()
        return ("image", image.size, color)

    return [
        {**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m
        for m in messages
    ]


def image(color):
    return ("image", SIZES[color], COLORS[color])


def problems_of(data: DataConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_prompt_samples(data, TASKS)
    return info.value.problems


def test_jsonl_paths_relative_to_the_file_absolute_and_lists(tmp_path, monkeypatch):
    images = write_pngs(tmp_path / "data" / "imgs")
    rows = [
        {"prompt": "One?", "image": "imgs/red.png"},
        {"prompt": "Two?", "image": str(images / "blue.png")},
        {"prompt": "Three?", "image": ["imgs/green.png", str(images / "red.png")]},
        {"prompt": "None?", "image": []},
    ]
    path = write_jsonl(tmp_path / "data" / "d.jsonl", rows)
    monkeypatch.chdir(tmp_path)  # relative paths are the data file's, not the cwd's
    samples = load_prompt_samples(config(path, system_prompt="Count."), TASKS)
    assert [s.idx for s in samples] == [0, 1, 2, 3]
    system = {"role": "system", "content": "Count."}
    text = [{"type": "text", "text": t} for t in ("One?", "Two?", "Three?")]
    assert [described(s.messages) for s in samples] == [
        [system, {"role": "user", "content": [image("red"), text[0]]}],
        [system, {"role": "user", "content": [image("blue"), text[1]]}],
        [system, {"role": "user", "content": [image("green"), image("red"), text[2]]}],
        [system, {"role": "user", "content": "None?"}],  # [] is a row without images
    ]


def test_message_list_prompts_get_the_images_in_their_first_user_message(tmp_path):
    write_pngs(tmp_path)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]  # fmt: skip
    rows = [{"prompt": chat, "image": "red.png"}, {"prompt": chat[:1], "image": "red.png"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert problems_of(config(path)) == [
        "row 1 (line 2 of d.jsonl): the prompt has no user message to hold the images of "
        "column 'image' (data.columns.images); add one"
    ]
    write_jsonl(path, rows[:1])
    [sample] = load_prompt_samples(config(path), TASKS)
    assert described(sample.messages) == [
        chat[0], {"role": "user", "content": [image("red"), {"type": "text", "text": "U"}]},
        *chat[2:],
    ]  # fmt: skip


def test_parquet_binary_bytes_and_stored_image_dicts(tmp_path):
    write_pngs(tmp_path)
    table = pa.table({
        "prompt": ["a", "b", "c"],
        "image": pa.array([png("red"), png("green"), png("blue")], pa.binary()),
        "images": [  # a datasets Image feature as Parquet stores it: {bytes, path} structs
            [{"bytes": png("blue"), "path": None}],
            [{"bytes": None, "path": "green.png"}, {"bytes": png("red"), "path": "x.png"}],
            [],
        ],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "d.parquet")
    samples = load_prompt_samples(config(tmp_path / "d.parquet"), TASKS)
    assert [described(s.messages)[0]["content"][0] for s in samples] == [
        image("red"), image("green"), image("blue"),
    ]  # fmt: skip
    data = DataConfig(
        path=str(tmp_path / "d.parquet"), columns=ColumnsConfig(task=None, images="images")
    )
    assert [described(s.messages)[0]["content"] for s in load_prompt_samples(data, TASKS)] == [
        [image("blue"), {"type": "text", "text": "a"}],
        [image("green"), image("red"), {"type": "text", "text": "b"}],  # path: next to the file
        "c",
    ]


def test_saved_dataset_with_image_features(tmp_path):
    from datasets import Dataset, List
    from datasets import Image as ImageFeature

    images = write_pngs(tmp_path / "imgs")
    dataset = Dataset.from_dict({
        "prompt": ["a", "b"],
        "image": [str(images / "red.png"), str(images / "blue.png")],
        "more": [[str(images / "green.png")], [str(images / "red.png"), str(images / "blue.png")]],
    }).cast_column("image", ImageFeature()).cast_column("more", List(ImageFeature()))  # fmt: skip
    dataset.save_to_disk(str(tmp_path / "saved"))
    for png_file in images.iterdir():  # the saved dataset holds the image bytes itself
        png_file.unlink()
    samples = load_prompt_samples(config(tmp_path / "saved"), TASKS)
    assert [described(s.messages)[0]["content"][0] for s in samples] == [
        image("red"), image("blue"),
    ]  # fmt: skip
    data = DataConfig(path=str(tmp_path / "saved"), columns=ColumnsConfig(task=None, images="more"))
    assert [described(s.messages)[0]["content"][:-1] for s in load_prompt_samples(data, TASKS)] == [
        [image("green")], [image("red"), image("blue")],
    ]  # fmt: skip


def test_every_bad_image_of_every_row_is_named_at_once(tmp_path):
    write_pngs(tmp_path / "imgs")
    (tmp_path / "broken.png").write_text("not a png")
    rows = [
        {"prompt": "ok", "image": "imgs/red.png"},
        {"prompt": "missing", "image": "imgs/purple.png"},
        {"prompt": "number", "image": 42},
        {"prompt": "null", "image": None},
        {"prompt": "two bad of three", "image": ["imgs/red.png", "broken.png", {"url": "x"}]},
        {"prompt": "ok too", "image": ["imgs/blue.png"]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    where = "(column 'image', data.columns.images)"
    assert problems_of(config(path)) == [
        f"row 1 (line 2 of d.jsonl): image 'imgs/purple.png' {where}: image file "
        f"'{tmp_path}/imgs/purple.png' does not exist; give an existing local path (relative "
        "paths in a dataset are relative to its data file).",
        f"row 2 (line 3 of d.jsonl): image 42 {where}: an image must be a PIL image, a local "
        'file path, encoded bytes or a {"bytes": ..., "path": ...} dict, got int.',
        "row 3 (line 4 of d.jsonl): no image (column 'image', data.columns.images); give the "
        "row its image(s), [] for a row without images, or drop the row",
        f"row 4 (line 5 of d.jsonl): image 1 'broken.png' {where}: '{tmp_path}/broken.png' is "
        "not a readable image (Pillow cannot identify its format); give a PNG, JPEG or "
        "another format Pillow reads.",
        f"row 4 (line 5 of d.jsonl): image 2 {{'url': 'x'}} {where}: an image must be a PIL "
        'image, a local file path, encoded bytes or a {"bytes": ..., "path": ...} dict, got '
        "dict.",
    ]


def test_undecodable_bytes_are_named_by_size_and_first_bytes(tmp_path):
    cut = [png("red"), b"\x89PNG but cut short", png("blue")[:40]]
    stored = [{"bytes": png("red"), "path": None}, {"bytes": b"GIF89a", "path": "g.gif"}, None]
    table = pa.table({"prompt": ["a", "b", "c"], "image": cut, "stored": stored})
    pq.write_table(table, tmp_path / "d.parquet")
    where = "(column 'image', data.columns.images)"
    fix = "give a PNG, JPEG or another format Pillow reads."
    assert problems_of(config(tmp_path / "d.parquet")) == [
        f"row 1 of d.parquet: image of 18 bytes b'\\x89PNG but cut'... {where}: the 18 bytes "
        f"given is not a readable image (Pillow cannot identify its format); {fix}",
        f"row 2 of d.parquet: image of 40 bytes b'\\x89PNG\\r\\n\\x1a\\n\\x00\\x00\\x00\\r'... "
        f"{where}: the 40 bytes given is not a readable image (Pillow cannot identify its "
        f"format); {fix}",
    ]
    data = DataConfig(
        path=str(tmp_path / "d.parquet"), columns=ColumnsConfig(task=None, images="stored")
    )
    where = "(column 'stored', data.columns.images)"
    assert problems_of(data) == [
        f"row 1 of d.parquet: image {{'bytes': 6 bytes, 'path': 'g.gif'}} {where}: the 6 bytes "
        f"given is not a readable image (Pillow cannot identify its format); {fix}",
        f"row 2 of d.parquet: no image {where}; give the row its image(s), [] for a row "
        "without images, or drop the row",
    ]


def test_a_missing_image_column_is_named_with_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "picture": "x.png"}])
    assert problems_of(config(path)) == [
        "data.columns.images: no column 'image' in the dataset (columns: prompt, picture)"
    ]


def test_many_bad_rows_name_the_rows_beyond_those_shown(tmp_path):
    rows = [{"prompt": f"p{i}", "image": None if i % 2 else []} for i in range(30)]
    problems = problems_of(config(write_jsonl(tmp_path / "d.jsonl", rows)))
    assert len(problems) == 11 and problems[0].startswith("row 1 (line 2 of d.jsonl): no image")
    assert problems[-1] == "... and 5 more, in rows 21, 23, 25, 27, 29"


def test_shuffled_rows_keep_their_images(tmp_path):
    write_pngs(tmp_path)
    colors = list(COLORS) * 4
    rows = [{"prompt": f"p{i}", "image": f"{c}.png"} for i, c in enumerate(colors)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    samples = load_prompt_samples(config(path, shuffle=True, seed=1), TASKS)
    assert sorted(s.idx for s in samples) == list(range(12))
    for s in samples:
        assert described(s.messages)[0]["content"] == [
            image(colors[s.idx]),
            {"type": "text", "text": f"p{s.idx}"},
        ]


def test_rollout_batch_tokenizes_with_the_processor_and_shares_images(tmp_path):
    processor = build_tiny_vlm_processor()
    write_pngs(tmp_path)
    rows = [{"prompt": "How many?", "image": ["red.png", "green.png"]},
            {"prompt": "Text only.", "image": []}]  # fmt: skip
    samples = load_prompt_samples(config(write_jsonl(tmp_path / "d.jsonl", rows)), TASKS)
    batch = build_rollout_batch(samples, processor, generations_per_prompt=2)
    assert batch.size == 4 and batch["idx"] == [0, 0, 1, 1]
    for i, sample in zip((0, 2), samples):
        [message] = batch["message_log"][i]
        expected = processor.apply_chat_template(
            [sample.messages], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        assert message["token_ids"].tolist() == expected["input_ids"][0]
        assert batch["length"][i] == len(expected["input_ids"][0])
    image_ids = batch["message_log"][0][0]["token_ids"] == processor.image_token_id
    assert int(image_ids.sum()) == 1 + 2  # 2x2 patches merged 2x2 -> 1 token; 2x4 -> 2
    first, second = batch["message_log"][0][0], batch["message_log"][1][0]
    assert first["image_grid_thw"].as_tensor().tolist() == [[1, 2, 2], [1, 2, 4]]
    assert torch.equal(
        first["pixel_values"].as_tensor(),
        processor.image_processor(
            [Image.open(tmp_path / "red.png"), Image.open(tmp_path / "green.png")],
            return_tensors="pt",
        )["pixel_values"],
    )
    assert "pixel_values" not in batch["message_log"][2][0]
    # the two generations of a prompt: separate messages, the same image data
    assert first is not second and first["content"] is not second["content"]
    assert second["pixel_values"][0] is first["pixel_values"][0]
    assert second["content"][0]["image"] is first["content"][0]["image"]
    assert batch["prompt_messages"][1][0]["content"][1]["image"] is first["content"][1]["image"]
