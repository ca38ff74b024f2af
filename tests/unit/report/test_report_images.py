"""report.html and reverify for a run whose messages hold images: thumbnails where the
image parts stand, deduplicated and capped, and (when Chromium is installed) loaded by a
real browser inside the right message."""

from __future__ import annotations

import base64
import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from envloop.data.multimodal_utils import content_images
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.models.tiny_vlm import build_tiny_vlm_processor
from envloop.report.page import build_report, report_context
from envloop.report.reverify import reverify_run
from envloop.report.thumbnails import MAX_THUMBNAILS, THUMBNAIL_PX
from envloop.run.outputs import RunWriter
from envloop.run.records import image_file_name, sample_records
from tests.fixtures.chromium import chromium, dump_dom
from tests.unit.run.image_rollouts import BLUE, QUESTION, RED, image_batch, png, shapes_image

needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium is not installed (apt-get install -y chromium)"
)
RED_NAME, BLUE_NAME = image_file_name(png(RED)), image_file_name(png(BLUE))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("image_report")
    with RunWriter(run) as writer:
        writer.add(sample_records(image_batch(build_tiny_vlm_processor())))
    return run


def page_data(html: str) -> dict:
    block = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', html, re.S)
    assert block is not None
    return json.loads(block.group(1))


def decoded(src: str) -> Image.Image:
    header, data = src.split(",", 1)
    assert header in ("data:image/png;base64", "data:image/jpeg;base64")
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_images_become_thumbnails_where_their_parts_stand(run_dir):
    html = build_report(run_dir).read_text(encoding="utf-8")
    data = page_data(html)
    first, second, text_only = data["samples"]
    assert first["messages"][1]["parts"] == [{"image": RED_NAME}, {"text": QUESTION}]
    assert first["messages"][1]["content"] == QUESTION  # the text that search and previews read
    assert first["messages"][3]["parts"] == [{"text": "Wrong. Look again:"}, {"image": BLUE_NAME}]
    assert second["messages"][1]["parts"][0] == {"image": RED_NAME}
    assert all("parts" not in m for m in text_only["messages"])
    assert list(data["images"]) == [RED_NAME, BLUE_NAME]  # RED once, for both samples
    red, blue = data["images"][RED_NAME], data["images"][BLUE_NAME]
    assert {k: red[k] for k in ("width", "height", "alt", "title")} == {
        "width": 84, "height": 56, "alt": "image, 84×56 px", "title": f"{RED_NAME} · 84×56 px",
    }  # fmt: skip
    assert (blue["width"], blue["height"], blue["title"]) == (42, 70, f"{BLUE_NAME} · 42×70 px")
    thumb = decoded(red["src"])
    assert thumb.size == (84, 56)  # small images are not enlarged
    if thumb.format == "PNG":  # lossless when PNG is the smaller encoding
        assert np.array_equal(np.asarray(thumb.convert("RGB")), np.asarray(RED))
    note = "3 images in messages (2 distinct), 2 shown as thumbnails."
    assert f'<p class="muted images-note">{note}</p>' in html


def test_large_images_shrink_to_the_thumbnail_size(tmp_path):
    big = shapes_image(300, 500, (255, 0, 0), seed=4)
    record = image_record(0, [big])
    context = report_context([record], None, None, "big", run_dir=write_images(tmp_path, [big]))
    [thumb] = context["data"]["images"].values()
    assert (thumb["width"], thumb["height"]) == (THUMBNAIL_PX, 77)  # 500x300 scaled by 128/500
    assert decoded(thumb["src"]).size == (THUMBNAIL_PX, 77)
    assert thumb["title"].endswith(" · 500×300 px")


def test_a_report_embeds_at_most_max_thumbnails(tmp_path):
    images = [shapes_image(28, 28, (0, 0, k), seed=k) for k in range(MAX_THUMBNAILS + 3)]
    run = write_images(tmp_path, images)
    records = [image_record(k, [image, images[0]]) for k, image in enumerate(images)]
    context = report_context(records, None, None, "many", run_dir=run)
    shown = context["data"]["images"]
    assert list(shown) == [image_file_name(png(image)) for image in images[:MAX_THUMBNAILS]]
    last = context["data"]["samples"][-1]["messages"][0]["parts"]
    assert last[0] == {
        "image": image_file_name(png(images[-1])),
        "note": f"left out: the report embeds at most {MAX_THUMBNAILS} images",
    }
    assert last[1] == {"image": image_file_name(png(images[0]))}  # still shown where it recurs
    assert context["images_note"] == (
        f"{2 * len(images)} images in messages ({len(images)} distinct), {MAX_THUMBNAILS} shown "
        f"as thumbnails; 3 left out (a report embeds at most {MAX_THUMBNAILS})."
    )
    thumbnail_bytes = sum(len(t["src"]) for t in shown.values())
    assert thumbnail_bytes < MAX_THUMBNAILS * 4 * 1024  # 28x28 noise: a few KB each


def test_missing_files_and_names_outside_the_run_directory_are_noted(tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes(png(RED))
    run = tmp_path / "run"
    run.mkdir()
    names = ["images/missing.png", "../secret.png", 7]
    parts = [{"type": "image", "image": name} for name in names]
    record = {**image_record(0, []), "messages": [{"role": "user", "content": parts}]}
    context = report_context([record], None, None, "run", run_dir=run)
    assert context["data"]["samples"][0]["messages"][0]["parts"] == [
        {"image": "images/missing.png", "note": "file not found or unreadable"},
        {"image": "../secret.png", "note": "not a file of the run directory"},
        {"image": "<int>", "note": "not a file of the run directory"},
    ]
    assert "images" not in context["data"]
    assert context["images_note"] == (
        "3 images in messages (3 distinct), 0 shown as thumbnails; 3 not shown (missing, "
        "unreadable or outside the run directory)."
    )
    without_run_dir = report_context([record], None, None, "run")["data"]["samples"][0]
    assert without_run_dir["messages"][0]["parts"][0] == {
        "image": "images/missing.png", "note": "not a file of the run directory",
    }  # fmt: skip


class LastImageWidth(EnvironmentInterface):
    """Rewards the width in pixels of the conversation's last image (0 without images)."""

    def step(self, message_log_batch, metadata, *args, **kwargs):
        widths = []
        for log in message_log_batch:
            images = [image for m in log for image in content_images(m["content"])]
            widths.append(float(images[-1].width) if images else 0.0)
        n = len(widths)
        return EnvironmentReturn(
            [{"role": "environment", "content": "ok"}] * n, list(metadata), [None] * n,
            torch.tensor(widths), torch.zeros(n, dtype=torch.bool),
        )  # fmt: skip

    def global_post_process_and_metrics(self, batch):
        return batch, {}


def test_reverify_gives_environments_the_stored_images(run_dir):
    env = LastImageWidth()
    summary = reverify_run(run_dir, {"count": env, "echo": env}, write=False)
    turns = [s["new_turn_rewards"] for s in summary["samples"]]
    assert turns == [[84.0, 42.0], [84.0], [0.0]]  # RED is 84 px wide, BLUE 42


class DomImages(HTMLParser):
    """Each message of the expanded trajectories: ``(sample, role, parts)``, parts being
    ``("text", text)`` or ``("img", attributes)`` in document order."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.messages: list[tuple[str, str, list]] = []
        self.sample = ""
        self._text: list[str] | None = None
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if "traj" in classes:
            self.sample = attrs["id"]
        elif "msg" in classes:
            self.messages.append((self.sample, classes[1].removeprefix("role-"), []))
        elif tag == "img":
            self.messages[-1][2].append(("img", attrs))
        elif "msg-text" in classes:
            self._text = []

    def handle_endtag(self, tag):
        if tag == "pre" and self._text is not None:
            self.messages[-1][2].append(("text", "".join(self._text)))
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)


MEASURE = """<script>
document.getElementById("f-expand").click();
var shown = Array.prototype.slice.call(document.querySelectorAll("img"));
Promise.all(shown.map(function (img) { return img.decode().catch(function () {}); })).then(
  function () {
    shown.forEach(function (img) { img.setAttribute("data-natural-width", img.naturalWidth); });
    document.body.setAttribute("data-measured", String(shown.length));
  });
</script>
</body>"""


@needs_chromium
@pytest.mark.slow
def test_chromium_loads_the_thumbnails_inside_their_messages(run_dir, tmp_path):
    html = build_report(run_dir).read_text(encoding="utf-8")
    page = tmp_path / "measured.html"  # the report, plus a script that expands every sample
    page.write_text(html.replace("</body>", MEASURE), encoding="utf-8")
    dom = dump_dom(page.as_uri())
    assert 'data-measured="3"' in dom
    messages = DomImages(dom).messages
    with_images = [
        (s, role, parts) for s, role, parts in messages if any(p[0] == "img" for p in parts)
    ]
    assert [(s, role, [kind for kind, _ in parts]) for s, role, parts in with_images] == [
        ("sample-0", "user", ["img", "text"]),
        ("sample-0", "environment", ["text", "img"]),
        ("sample-1", "user", ["img", "text"]),
    ]
    images = [attrs for _, _, parts in with_images for kind, attrs in parts if kind == "img"]
    assert [(a["data-natural-width"], a["width"], a["height"]) for a in images] == [
        ("84", "84", "56"), ("42", "42", "70"), ("84", "84", "56"),
    ]  # fmt: skip
    assert [a["title"] for a in images] == [f"{RED_NAME} · 84×56 px", f"{BLUE_NAME} · 42×70 px",
                                            f"{RED_NAME} · 84×56 px"]  # fmt: skip
    assert all(
        a["alt"].startswith("image, ") and a["src"].startswith("data:image/") for a in images
    )
    assert with_images[1][2][0] == ("text", "Wrong. Look again:")


def write_images(run: Path, images: list[Image.Image]) -> Path:
    """``run`` with each image's PNG in ``images/`` under its content name."""
    (run / "images").mkdir(parents=True, exist_ok=True)
    for image in images:
        (run / image_file_name(png(image))).write_bytes(png(image))
    return run


def image_record(sample: int, images: list[Image.Image]) -> dict:
    """A rollouts.jsonl record whose user message shows ``images`` then a question."""
    parts = [{"type": "image", "image": image_file_name(png(image))} for image in images]
    content = [*parts, {"type": "text", "text": QUESTION}]
    return {
        "sample": sample, "idx": sample, "task": "count", "generation": 0,
        "messages": [{"role": "user", "content": content, "num_tokens": 9},
                     {"role": "assistant", "content": "one", "num_tokens": 2}],
        "total_reward": 1.0, "rewards": {}, "turn_rewards": [1.0], "num_turns": 1,
        "truncated": False, "terminated": True, "error": None, "ground_truth": "1",
        "extra_env_info": {}, "initial_extra_env_info": {},
    }  # fmt: skip
