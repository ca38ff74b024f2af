"""The vision demo's synthetic tasks: small images of coloured shapes, made with PIL.

A :class:`Scene` is one to four non-overlapping shapes (circle, square, triangle; red, green,
blue, yellow) on a plain light-grey canvas of :data:`IMAGE_SIZE` pixels square, drawn
without anti-aliasing, so every pixel is either background or exactly one shape's colour.
Two tasks ask about it, in the formats the ``vlm`` environment's reward functions parse:

- **count_shapes**: ``How many red shapes are in the image? ...`` or ``How many shapes are
  in the image? ...``, answered ``<answer>2</answer>``; answers 1..4, equally likely (scored
  by ``exact_alnum``; chance is 1/4).
- **locate_shape**: ``Where is the red triangle? ...``, answered with its box in pixels,
  ``<answer>[12, 30, 27, 44]</answer>`` (scored by ``bbox_giou``). A box ``[x1, y1, x2,
  y2]`` holds the pixel columns x1..x2-1 and rows y1..y2-1: the shape's pixels touch all
  four sides of it. No other shape in the scene has the named shape's colour.

Every row is a pure function of its seed. A fixed tenth of the scenes (:func:`is_held_out`,
a hash of the scene) never appears in training; evaluation and the demo dataset draw from it.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

IMAGE_SIZE = 84
"""Width and height of every image: 6x6 patches of 14 px, 9 image tokens after merging. A
multiple of 28, so Qwen2-VL image processors keep the size: box pixels are the model's."""
BACKGROUND = (236, 236, 236)
COLOURS = {
    "red": (220, 50, 47),
    "green": (40, 160, 60),
    "blue": (38, 90, 210),
    "yellow": (230, 190, 20),
}
KINDS = ("circle", "square", "triangle")
MAX_SHAPES = 4
SIDE_RANGE = (18, 28)
"""Smallest and largest shape side in pixels."""
GAP = 3
"""Fewest pixels between two shapes' boxes."""
COUNT_TASK, LOCATE_TASK = "count_shapes", "locate_shape"
ANSWER_FORMAT = "Answer with a number in <answer></answer>."
BOX_FORMAT = "Answer with its box [x1, y1, x2, y2] in pixels, in <answer></answer>."
HELD_OUT_SEED = 1_000_000
"""Rows drawn from seeds below this are for training, from it on for evaluation."""

Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class Shape:
    """One shape and its box ``(x1, y1, x2, y2)``: pixel columns x1..x2-1, rows y1..y2-1."""

    kind: str
    colour: str
    box: Box

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    """Shapes on the canvas, in drawing order (their boxes never overlap)."""

    shapes: tuple[Shape, ...]

    def image(self) -> Image.Image:
        """The scene as an RGB image of ``IMAGE_SIZE`` x ``IMAGE_SIZE`` pixels."""
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
        draw = ImageDraw.Draw(image)
        for shape in self.shapes:
            _draw_shape(draw, shape)
        return image


@dataclass(frozen=True)
class VisualRow:
    """One question about a scene: its image, prompt text, ground truth and task name.

    ``ground_truth`` is the count as text (``"2"``) or the box as a list of 4 ints.
    """

    scene: Scene
    prompt: str
    ground_truth: str | list[int]
    task: str

    def image(self) -> Image.Image:
        return self.scene.image()

    def response(self) -> str:
        """The right reply, ``<answer>2</answer>`` or ``<answer>[12, 30, 27, 44]</answer>``."""
        return answer_text(self.ground_truth)


def answer_text(answer: str | list[int]) -> str:
    """A reply holding ``answer`` (a count, or a box written as ``[x1, y1, x2, y2]``).

    >>> answer_text("3"), answer_text([1, 2, 30, 40])
    ('<answer>3</answer>', '<answer>[1, 2, 30, 40]</answer>')
    """
    text = answer if isinstance(answer, str) else "[" + ", ".join(map(str, answer)) + "]"
    return f"<answer>{text}</answer>"


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    x1, y1, x2, y2 = shape.box
    corners, fill = (x1, y1, x2 - 1, y2 - 1), COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse(corners, fill=fill)
    elif shape.kind == "square":
        draw.rectangle(corners, fill=fill)
    else:  # a triangle pointing up, its apex on the top row
        draw.polygon([(x1, y2 - 1), (x2 - 1, y2 - 1), ((x1 + x2 - 1) // 2, y1)], fill=fill)


def _free_box(rng: random.Random, taken: list[Box], sides: tuple[int, int]) -> Box | None:
    """A random square box, its side in ``sides``, at least ``GAP`` pixels from every box of
    ``taken`` (None: no room found in 100 tries)."""
    for _ in range(100):
        side = rng.randint(*sides)
        x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
        box = (x, y, x + side, y + side)
        if all(_apart(box, other) for other in taken):
            return box
    return None


def _apart(a: Box, b: Box) -> bool:
    return a[2] + GAP <= b[0] or b[2] + GAP <= a[0] or a[3] + GAP <= b[1] or b[3] + GAP <= a[1]


def place_shapes(
    rng: random.Random, looks: list[tuple[str, str]], sides: tuple[int, int] = SIDE_RANGE
) -> Scene | None:
    """A scene of shapes with these ``(kind, colour)`` looks at random places, their sides
    in ``sides`` (None when they do not fit)."""
    shapes: list[Shape] = []
    for kind, colour in looks:
        box = _free_box(rng, [s.box for s in shapes], sides)
        if box is None:
            return None
        shapes.append(Shape(kind, colour, box))
    return Scene(tuple(shapes))


def is_held_out(scene: Scene) -> bool:
    """Whether ``scene`` belongs to the held-out tenth (a fixed hash of its shapes)."""
    text = ";".join(f"{s.name}@{s.box}" for s in scene.shapes)
    return zlib.crc32(text.encode()) % 10 == 0


def counting_row(rng: random.Random, sides: tuple[int, int] = SIDE_RANGE) -> VisualRow | None:
    """A counting question whose answer (1..4) is drawn uniformly: about every shape, or
    about one colour (other colours fill the scene up to a random total)."""
    answer = rng.randint(1, MAX_SHAPES)
    colours = list(COLOURS)
    if rng.random() < 0.5:
        looks = [(rng.choice(KINDS), rng.choice(colours)) for _ in range(answer)]
        question = "How many shapes are in the image?"
    else:
        colour = rng.choice(colours)
        others = [c for c in colours if c != colour]
        extra = rng.randint(0, MAX_SHAPES - answer)
        looks = [(rng.choice(KINDS), colour) for _ in range(answer)]
        looks += [(rng.choice(KINDS), rng.choice(others)) for _ in range(extra)]
        rng.shuffle(looks)
        question = f"How many {colour} shapes are in the image?"
    scene = place_shapes(rng, looks, sides)
    if scene is None:
        return None
    return VisualRow(scene, f"{question} {ANSWER_FORMAT}", str(answer), COUNT_TASK)


def grounding_row(rng: random.Random, sides: tuple[int, int] = SIDE_RANGE) -> VisualRow | None:
    """A question for the box of a named shape (colour and kind) in a scene of 1..4 shapes;
    no other shape has its colour."""
    looks = [(kind, colour) for kind in KINDS for colour in COLOURS]
    target = rng.choice(looks)
    others = [look for look in looks if look[1] != target[1]]
    scene_looks = [target] + [rng.choice(others) for _ in range(rng.randint(0, MAX_SHAPES - 1))]
    rng.shuffle(scene_looks)
    scene = place_shapes(rng, scene_looks, sides)
    if scene is None:
        return None
    shape = next(s for s in scene.shapes if (s.kind, s.colour) == target)
    prompt = f"Where is the {shape.name}? {BOX_FORMAT}"
    return VisualRow(scene, prompt, list(shape.box), LOCATE_TASK)


TASK_ROWS = {COUNT_TASK: counting_row, LOCATE_TASK: grounding_row}


def visual_row(task: str, seed: int, sides: tuple[int, int] = SIDE_RANGE) -> VisualRow | None:
    """The row of ``task`` drawn from ``seed``, shape sides in ``sides`` (None when its
    shapes did not fit). Training starts on larger shapes than the demo's.

    >>> row = visual_row("count_shapes", 3)
    >>> row.prompt
    'How many yellow shapes are in the image? Answer with a number in <answer></answer>.'
    >>> row.ground_truth, row.response(), [shape.colour for shape in row.scene.shapes]
    ('3', '<answer>3</answer>', ['yellow', 'yellow', 'yellow'])
    """
    if task not in TASK_ROWS:
        raise ValueError(f"No visual task {task!r}; the tasks are {', '.join(TASK_ROWS)}.")
    return TASK_ROWS[task](random.Random(f"{task}-{seed}"), sides)


def row_stream(task: str, held_out: bool, start: int = 0) -> Iterator[VisualRow]:
    """Endless rows of ``task`` from consecutive seeds: training ones (``held_out=False``,
    seeds from ``start``) or held-out ones (seeds from ``HELD_OUT_SEED + start``), each
    scene on its side of :func:`is_held_out`."""
    seed = start + (HELD_OUT_SEED if held_out else 0)
    while True:
        row = visual_row(task, seed)
        if row is not None and is_held_out(row.scene) == held_out:
            yield row
        seed += 1


def visual_rows(task: str, num: int, held_out: bool, start: int = 0) -> list[VisualRow]:
    """The first ``num`` rows of :func:`row_stream`."""
    return list(itertools.islice(row_stream(task, held_out, start), num))


def demo_rows(num_count: int = 12, num_locate: int = 12) -> list[VisualRow]:
    """The vision demo dataset's rows, all held out from training: counting questions then
    grounding questions."""
    return visual_rows(COUNT_TASK, num_count, True) + visual_rows(LOCATE_TASK, num_locate, True)


def row_messages(row: VisualRow) -> list[dict[str, Any]]:
    """The conversation the policy sees: one user message, the image then the prompt."""
    content = [{"type": "image", "image": row.image()}, {"type": "text", "text": row.prompt}]
    return [{"role": "user", "content": content}]


def rollout_batch(task: str, rows: list[VisualRow], processor: Any) -> Any:
    """``rows`` of ``task`` as a rollout input batch: each conversation tokenized through the
    policy's ``processor`` with the generation prompt, its ground truth as metadata."""
    from envloop.data.llm_message_utils import get_formatted_message_log  # imports torch
    from envloop.distributed.batched_data_dict import BatchedDataDict

    logs = [
        get_formatted_message_log(row_messages(row), processor, add_generation_prompt=True)
        for row in rows
    ]
    return BatchedDataDict(
        message_log=logs,
        task_name=[task] * len(rows),
        extra_env_info=[{"ground_truth": row.ground_truth} for row in rows],
        stop_strings=[None] * len(rows),
    )


REWARD_FUNCTIONS: dict[str, list[dict[str, Any]]] = {
    COUNT_TASK: [{"name": "exact_alnum", "weight": 1.0}],
    LOCATE_TASK: [{"name": "bbox_giou", "weight": 1.0}],
}
"""Each task's ``reward_functions`` in its ``vlm`` environment config: a count scores 1 when
exact, a box ``(GIoU + 1) / 2`` against the true box (correct when IoU >= 0.5)."""


def demo_records(image_dir: str = "vlm_demo_images") -> list[tuple[dict[str, Any], Image.Image]]:
    """The vision demo dataset: for each of :func:`demo_rows`, its JSONL row (``task``,
    ``prompt``, ``images``: the path of its PNG relative to the data file, ``ground_truth``)
    and its image."""
    records = []
    for i, row in enumerate(demo_rows()):
        path = f"{image_dir}/{i:02d}_{row.task}.png"
        record = {"task": row.task, "prompt": row.prompt, "images": [path]}
        records.append(({**record, "ground_truth": row.ground_truth}, row.image()))
    return records
