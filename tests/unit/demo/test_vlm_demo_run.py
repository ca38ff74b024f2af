"""``examples/vlm_demo.yaml`` end to end, as ``make demo`` runs it (one generation per
prompt here): the bundled tiny vision-language policy counts and locates shapes in the
held-out pictures, scored by the vlm environment on Ray actors, well above chance."""

from __future__ import annotations

import pytest

from tests.fixtures.demo_runs import run_example

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, ray_session):
    out_dir = tmp_path_factory.mktemp("vlm_demo") / "run"
    return (*run_example("vlm_demo.yaml", out_dir), out_dir)


def test_the_policy_counts_shapes_well_above_chance(demo_run):
    status, printed, records, _ = demo_run
    assert status == 0, printed
    counts = [r for r in records if r["task"] == "count_shapes"]
    assert len(counts) == 12
    for record in counts:
        assert record["messages"][1]["content"].startswith("<answer>")
    accuracy = sum(r["total_reward"] for r in counts) / len(counts)
    assert accuracy >= 0.5  # chance: 1 in 4 (answers 1 to 4)


def test_the_policy_boxes_shapes_it_is_asked_about(demo_run):
    _, _, records, _ = demo_run
    boxes = [r for r in records if r["task"] == "locate_shape"]
    assert len(boxes) == 12
    hits = sum(bool(r["extra_env_info"]["correct"]) for r in boxes)  # IoU >= 0.5
    assert hits >= 2  # a box of the whole picture, or its centre, hits none of them


def test_the_run_directory_keeps_the_pictures(demo_run):
    _, _, records, out_dir = demo_run
    first = records[0]["messages"][0]["content"][0]
    assert first["type"] == "image" and (out_dir / first["image"]).is_file()
    assert (out_dir / "report.html").read_text().count("data:image/") >= 24
