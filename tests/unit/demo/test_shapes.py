"""The vision demo's synthetic tasks: rows are a function of their seed, every box is exactly
its shape's pixels, answers count what the question names, the ``vlm`` environment scores
the right replies 1 and wrong ones less, and the committed demo dataset is what
``demo_records`` makes (and loads as an image dataset)."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from envloop.data.dataset_config import DataConfig
from envloop.data.datasets import load_prompt_samples
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.tokenization import tokenize_texts
from envloop.demo import ASSETS, shapes
from envloop.environments.vlm_environment import VLMEnvironment
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.processors import load_processor

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ROWS = {task: shapes.visual_rows(task, 200, held_out=False) for task in shapes.TASK_ROWS}


def test_a_row_is_a_function_of_its_task_and_seed():
    row = shapes.visual_row(shapes.LOCATE_TASK, 0)
    again = shapes.visual_row(shapes.LOCATE_TASK, 0)
    assert row == again and row.image().tobytes() == again.image().tobytes()
    assert row.prompt == (
        "Where is the blue square? Answer with its box [x1, y1, x2, y2] in pixels, in "
        "<answer></answer>."
    )
    assert row.ground_truth == [5, 31, 23, 49]
    assert row.response() == "<answer>[5, 31, 23, 49]</answer>"
    assert [s.name for s in row.scene.shapes] == [
        "red square", "yellow circle", "red triangle", "blue square",
    ]  # fmt: skip
    count = shapes.visual_row(shapes.COUNT_TASK, 0)
    assert (count.prompt, count.ground_truth) == (
        "How many green shapes are in the image? Answer with a number in <answer></answer>.",
        "2",
    )
    assert shapes.visual_row(shapes.LOCATE_TASK, 1) != row
    with pytest.raises(ValueError, match="^No visual task 'count'; the tasks are count_shapes"):
        shapes.visual_row("count", 0)


def test_every_box_holds_exactly_its_shapes_pixels():
    for row in itertools.chain(*ROWS.values()):
        pixels = np.asarray(row.image())
        assert pixels.shape == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3)
        covered = np.zeros(pixels.shape[:2], dtype=bool)
        for shape in row.scene.shapes:
            x1, y1, x2, y2 = shape.box
            assert 0 <= x1 < x2 <= shapes.IMAGE_SIZE and 0 <= y1 < y2 <= shapes.IMAGE_SIZE
            alone = np.asarray(shapes.Scene((shape,)).image())
            drawn = (alone != shapes.BACKGROUND).any(-1)
            ys, xs = np.nonzero(drawn)
            assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == shape.box, shape
            # Drawn in one flat colour, and the same in the scene (shapes never overlap).
            assert (alone[drawn] == shapes.COLOURS[shape.colour]).all()
            assert (pixels[drawn] == shapes.COLOURS[shape.colour]).all()
            covered[y1:y2, x1:x2] = True
        assert not ((pixels != shapes.BACKGROUND).any(-1) & ~covered).any()
        for a, b in itertools.combinations([s.box for s in row.scene.shapes], 2):
            gap = max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])
            assert gap >= shapes.GAP


def test_counting_answers_count_the_named_shapes_and_are_equally_likely():
    rows = shapes.visual_rows(shapes.COUNT_TASK, 800, held_out=False)
    for row in rows:
        named = row.prompt.split()[2]  # "How many red shapes ..." or "How many shapes ..."
        counted = [s for s in row.scene.shapes if named in ("shapes", s.colour)]
        assert row.ground_truth == str(len(counted))
        assert 1 <= len(row.scene.shapes) <= shapes.MAX_SHAPES
        assert row.response() == f"<answer>{len(counted)}</answer>"
    answers = Counter(row.ground_truth for row in rows)
    assert sorted(answers) == ["1", "2", "3", "4"]
    assert min(answers.values()) >= 160  # 200 expected each
    about_all = sum(row.prompt.startswith("How many shapes") for row in rows)
    assert 320 <= about_all <= 480  # half expected


def test_the_located_shape_is_the_only_one_of_its_colour():
    for row in ROWS[shapes.LOCATE_TASK]:
        colour, kind = row.prompt.split("?")[0].split()[-2:]
        same_colour = [s for s in row.scene.shapes if s.colour == colour]
        assert [(s.kind, list(s.box)) for s in same_colour] == [(kind, row.ground_truth)]
        assert 1 <= len(row.scene.shapes) <= shapes.MAX_SHAPES
    sizes = Counter(len(row.scene.shapes) for row in ROWS[shapes.LOCATE_TASK])
    assert sorted(sizes) == [1, 2, 3, 4]


def test_held_out_scenes_never_appear_among_training_rows():
    for task, rows in ROWS.items():
        held_out = shapes.visual_rows(task, 50, held_out=True)
        assert all(shapes.is_held_out(row.scene) for row in held_out)
        assert not any(shapes.is_held_out(row.scene) for row in rows)
        drawn = [shapes.visual_row(task, seed) for seed in range(1000)]
        share = sum(shapes.is_held_out(r.scene) for r in drawn if r is not None) / len(drawn)
        assert 0.07 < share < 0.13


def test_larger_shapes_for_the_training_curriculum():
    row = shapes.visual_row(shapes.LOCATE_TASK, 3, sides=(30, 40))
    assert all(30 <= s.box[2] - s.box[0] <= 40 for s in row.scene.shapes)
    assert shapes.visual_row(shapes.LOCATE_TASK, 3) != row


def wrong_reply(row: shapes.VisualRow) -> str:
    """A count one off (4 becomes 1), or the box moved right by its width (touching it)."""
    if row.task == shapes.COUNT_TASK:
        return shapes.answer_text(str(int(row.ground_truth) % shapes.MAX_SHAPES + 1))
    x1, y1, x2, y2 = row.ground_truth
    return shapes.answer_text([x2, y1, 2 * x2 - x1, y2])


@pytest.mark.parametrize("task", list(shapes.TASK_ROWS))
def test_the_vlm_environment_scores_right_replies_1_and_wrong_ones_less(task):
    rows = ROWS[task][:40]
    env = VLMEnvironment({"reward_functions": shapes.REWARD_FUNCTIONS[task]})
    # Ground truths as the dataset gives them: a count as text, a box as JSON text.
    truths = [{"ground_truth": json.dumps(row.ground_truth)} for row in rows]
    if task == shapes.COUNT_TASK:
        truths = [{"ground_truth": row.ground_truth} for row in rows]
    try:
        for replies, reward, correct in [
            ([row.response() for row in rows], 1.0, True),
            ([wrong_reply(row) for row in rows], 0.0 if task == shapes.COUNT_TASK else 0.5, False),
        ]:
            logs = [[{"role": "assistant", "content": reply}] for reply in replies]
            ret = env.step(logs, truths)
            assert ret.rewards.tolist() == [reward] * len(rows)
            assert [md["correct"] for md in ret.metadata] == [correct] * len(rows)
    finally:
        env.shutdown()


def test_committed_vlm_demo_dataset_is_demo_records_and_held_out():
    records = shapes.demo_records()
    lines = (EXAMPLES / "vlm_demo_data.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [record for record, _ in records]
    for record, image in records:
        with Image.open(EXAMPLES / record["images"][0]) as stored:
            assert stored.mode == "RGB" and stored.tobytes() == image.tobytes()
    assert Counter(r["task"] for r, _ in records) == {shapes.COUNT_TASK: 12, shapes.LOCATE_TASK: 12}
    assert all(shapes.is_held_out(row.scene) for row in shapes.demo_rows())
    assert sum(p.stat().st_size for p in (EXAMPLES / "vlm_demo_images").iterdir()) < 40_000


def test_the_demo_dataset_loads_as_an_image_dataset():
    data = DataConfig(path=str(EXAMPLES / "vlm_demo_data.jsonl"), columns={"images": "images"})
    samples = load_prompt_samples(data, dict.fromkeys(shapes.TASK_ROWS, True))
    for sample, row in zip(samples, shapes.demo_rows(), strict=True):
        (message,) = sample.messages
        image, text = message["content"]
        assert image["image"].tobytes() == row.image().tobytes()
        assert text == {"type": "text", "text": row.prompt}
        assert message["role"] == "user"
        assert (sample.task, sample.extra_env_info["ground_truth"]) == (
            row.task,
            row.ground_truth if row.task == shapes.COUNT_TASK else json.dumps(row.ground_truth),
        )


@pytest.fixture(scope="module")
def vlm_policy():
    return HfGeneration({"model_name": str(ASSETS / "vlm_policy"), "max_new_tokens": 24})


def test_the_bundled_vlm_policy_loads_and_reads_a_demo_row():
    folder = ASSETS / "vlm_policy"
    processor = load_processor(str(folder))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    row = shapes.demo_rows()[0]
    (message,) = get_formatted_message_log(
        shapes.row_messages(row), processor, add_generation_prompt=True
    )
    ids = message["token_ids"][None]
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            pixel_values=message["pixel_values"].as_tensor(),
            image_grid_thw=message["image_grid_thw"].as_tensor(),
        ).logits
    assert message["image_grid_thw"].as_tensor().tolist() == [[1, 6, 6]]
    assert logits.shape == (1, len(message["token_ids"]), len(processor.tokenizer))
    # The reply starts as trained: "<answer>" is its first token(s).
    first = processor.tokenizer.decode(logits[0, -1].argmax())
    assert "<answer>".startswith(first)
    assert processor.tokenizer.tokenize("12") == ["1", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("task", list(shapes.TASK_ROWS))
def test_the_bundled_vlm_policy_beats_chance_on_the_demo_rows(vlm_policy, task):
    """Greedy rollouts of the held-out demo rows through the engine and the vlm environment."""
    rows = [row for row in shapes.demo_rows() if row.task == task]
    processor = vlm_policy.processor
    batch = shapes.rollout_batch(task, rows, processor)
    env = VLMEnvironment({"reward_functions": shapes.REWARD_FUNCTIONS[task]})
    try:
        final, _ = run_multi_turn_rollout(
            vlm_policy, batch, processor, {task: env}, 512, max_rollout_turns=1, greedy=True
        )
    finally:
        env.shutdown()
    replies = [log[1]["content"] for log in final["message_log"]]
    assert all(re.fullmatch(r"<answer>[^<]+</answer>", reply) for reply in replies), replies
    # Each reply is the tokens it was trained as: the reply text's own tokens, then EOS.
    eos = processor.tokenizer.eos_token_id
    for log, ids in zip(final["message_log"], tokenize_texts(processor.tokenizer, replies)):
        assert log[1]["token_ids"].tolist() == [*ids, eos]
    correct = [md["correct"] for md in final["extra_env_info"]]
    mean_reward = final["total_reward"].mean().item()
    if task == shapes.COUNT_TASK:
        assert sum(correct) >= 7  # 8 of 12 when trained; chance: 3
    else:
        assert sum(correct) >= 6  # 8 of 12 when trained (IoU >= 0.5); a fixed box: none
        assert mean_reward > 0.6  # 0.69 when trained; the whole image: 0.54
