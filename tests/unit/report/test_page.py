"""report.html from a hand-written run directory: content, numbers, escaping, and (when
Chromium is installed) how a real browser renders it."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path

import jinja2
import pytest
import yaml
from jinja2 import meta

from envloop.report.page import (
    PALETTE,
    TEMPLATE,
    TOKENS_COLOR,
    TURNS_COLOR,
    build_report,
    off_scale_tasks,
    render_report,
    report_context,
)
from envloop.report.sections import fmt
from envloop.report.templates import environment, render
from tests.fixtures.chromium import chromium, dump_dom, screenshot
from tests.fixtures.png_image import read_png
from tests.fixtures.run_dirs import (
    RM_TEXT,
    fixture_config,
    fixture_metrics,
    fixture_records,
    write_run_dir,
)

needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="chromium is not installed (apt-get install -y chromium)"
)


VOID = {"meta", "input", "br", "img", "link", "hr"}  # elements with no end tag


class Page(HTMLParser):
    """Tables (cell texts by row), start tags with attributes, script bodies, and the text
    of every element by tag name and by ``.class`` (character references decoded)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.tables: list[list[list[str]]] = []
        self.scripts: list[str] = []
        self.texts: dict[str, list[str]] = {}
        self._open: list[tuple[str, list[str], list[str]]] = []  # tag, keys, text so far
        self._cell: list[str] | None = None
        self._in_script = False
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            classes = (dict(attrs).get("class") or "").split()
            self._open.append((tag, [tag] + ["." + c for c in classes], []))
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "script":
            self._in_script = True
            self.scripts.append("")

    def handle_endtag(self, tag):
        while self._open:
            name, keys, text = self._open.pop()
            for key in keys:
                self.texts.setdefault(key, []).append("".join(text).strip())
            if self._open:
                self._open[-1][2].extend(text)
            if name == tag:
                break
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._open:
            self._open[-1][2].append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._in_script:
            self.scripts[-1] += data

    def kv(self) -> dict[str, str]:
        """Every two-cell row of every table: first cell -> second."""
        return {r[0]: r[1] for t in self.tables for r in t if len(r) == 2}

    def tiles(self) -> list[tuple[str, str, str]]:
        """The headline tiles: ``(label, value, note)``."""
        return list(
            zip(self.texts[".kpi-label"], self.texts[".kpi-value"], self.texts[".kpi-note"])
        )


def strict_json(text: str):
    """Parse like a browser's JSON.parse: NaN and Infinity are errors."""

    def reject(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=reject)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run_dir(tmp_path / "run")


@pytest.fixture
def report(run_dir: Path) -> tuple[Path, str]:
    path = build_report(run_dir)
    return path, path.read_text(encoding="utf-8")


def test_build_report_writes_one_self_contained_page(run_dir, report):
    path, html = report
    assert path == run_dir / "report.html"
    assert html.startswith("<!DOCTYPE html>")
    page = Page(html)
    fetching = [
        (tag, attrs) for tag, attrs in page.tags
        if tag in ("link", "img", "iframe", "object", "embed")
        or any(k in ("src", "srcset", "data") for k in attrs)
        or (attrs.get("href") or "#").startswith("#") is False
    ]  # fmt: skip
    assert fetching == []
    assert not re.search(r"https?://|@import|url\(", html)
    csp = [a["content"] for t, a in page.tags if a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and csp[0].startswith("default-src 'none';")
    script_types = [a.get("type") for t, a in page.tags if t == "script"]
    assert script_types == ["application/json", None]


def test_summary_numbers_match_the_run(report):
    page = Page(report[1])
    metrics = fixture_metrics(fixture_records())
    tasks = {row[0]: row for row in page.tables[0][1:]}
    assert list(tasks) == ["math", "sliding_puzzle", "preference"]
    for task, stats in metrics["per_task"].items():
        assert tasks[task][2] == str(stats["num_samples"])
        assert tasks[task][3] == fmt(stats["mean_reward"])
    assert tasks["preference"][1:11] == [
        "reward_model", "2", "0.2188", "-0.375", "0.8125", "50%", "1", "33", "0", "0",
    ]  # fmt: skip
    kv = page.kv()
    for key, value in {**metrics["rollout"], **metrics["envs"]["math"]}.items():
        assert kv[key] == fmt(value)
    assert kv["wall_time_s"] == "12.5" and kv["policy.model_name"] == "bundled:policy"
    assert kv["rollout.max_turns"] == "4" and kv["rollout.observation_format"] == "chat_template"
    per_task = {task: fmt(stats["mean_reward"]) for task, stats in metrics["per_task"].items()}
    assert page.tiles() == [
        ("samples", "8", "3 tasks"),
        ("math", per_task["math"], "mean reward · min 0 · max 1"),
        ("sliding_puzzle", per_task["sliding_puzzle"], "mean reward · min 0 · max 1"),
        ("preference", per_task["preference"], "mean reward · min -0.375 · max 0.8125"),
        ("mean turns", "1.375", "max 2"), ("mean tokens", "50.62", "per sample"),
        ("truncated", "1", "12% of samples"), ("env errors", "1", "12% of samples"),
        ("wall time", "12.5 s", "whole run"),
    ]  # fmt: skip
    assert per_task == {"math": "0.5", "sliding_puzzle": "0.5", "preference": "0.2188"}
    dots = [a["style"] for t, a in page.tags if a.get("class") == "dot"][:3]
    assert dots == [f"background:{color}" for color in PALETTE[:3]]  # the tiles' task colours


def test_histograms_count_every_sample(report):
    html = report[1]
    assert html.count('<svg class="hist"') == 3 + 3  # reward per task, turns, two token charts
    tips = re.findall(r"<title>([^<]*)</title>", html)
    assert "turns 1: 5 samples" in tips and "turns 2: 3 samples" in tips
    assert "total reward 0: 2 samples" in tips and "total reward 1: 2 samples" in tips
    assert "total reward -0.375: 1 sample" in tips and "total reward 0.812: 1 sample" in tips
    counted = [int(t.rsplit(": ", 1)[1].split()[0]) for t in tips if t.startswith("tokens")]
    assert sum(counted) == 8
    fills = re.findall(r'<rect class="bar"[^>]* fill="([^"]+)"', html)
    assert set(fills) >= {PALETTE[0], PALETTE[1], PALETTE[2], TURNS_COLOR, TOKENS_COLOR}


def test_run_text_is_escaped_everywhere(tmp_path):
    records = fixture_records()
    records[7]["task"] = "<i>evil</i>"
    html = render_report(
        records, {"data": {"path": "</script><script>alert(2)</script>"}}, None, "<b>run</b>"
    )
    assert "<script>alert" not in html and "<i>evil</i>" not in html and "<b>run" not in html
    assert "&lt;i&gt;evil&lt;/i&gt;" in html and "&lt;b&gt;run&lt;/b&gt;" in html
    assert "&lt;/script&gt;&lt;script&gt;alert(2)" in html
    page = Page(html)
    assert len(page.scripts) == 2
    data = strict_json(page.scripts[0])
    assert data["samples"][6]["messages"][2]["content"] == RM_TEXT
    assert data["samples"][7]["task"] == "<i>evil</i>"
    assert list(data["colors"]) == ["math", "sliding_puzzle", "preference", "<i>evil</i>"]


EVIL = "<script>alert(1)</script>{{ x }}</script>&amp;"
EVIL_HTML = "&lt;script&gt;alert(1)&lt;/script&gt;{{ x }}&lt;/script&gt;&amp;amp;"


def evil_run() -> tuple[list[dict], dict, dict]:
    """The fixture run with EVIL as a task name, a message, config values (the model, the
    data path, an environment's name and config), metric names and a metric value."""
    records = fixture_records()
    records[7]["task"] = EVIL
    records[0]["messages"][0]["content"] = EVIL
    config = fixture_config()
    config["policy"]["model_name"] = config["data"]["path"] = EVIL
    config["envs"][EVIL] = {"name": EVIL, "config": {"k": EVIL}}
    metrics = fixture_metrics(records)
    metrics["rollout"][EVIL] = 1.5
    metrics["envs"][EVIL] = {"acc/" + EVIL: EVIL}
    return records, config, metrics


def test_user_text_is_escaped_by_the_templates_everywhere():
    records, config, metrics = evil_run()
    html = render_report(records, config, metrics, EVIL)
    page = Page(html)
    assert [t for t, _ in page.tags].count("script") == 2 and html.count("</script>") == 2
    assert "<script>alert" not in html and "&amp;amp;" in html
    # each place shows the text exactly (escaped once: decoding gives it back whole)
    assert page.texts["title"][0] == f"envloop run report: {EVIL}" and page.texts["h1"] == [EVIL]
    assert page.texts[".subtitle"] == [f"8 samples · 4 tasks · policy {EVIL}"]
    assert page.tiles()[4] == (EVIL, "-0.375", "mean reward · min -0.375 · max -0.375")
    assert [row[0] for row in page.tables[0][1:]][3] == EVIL  # the task table
    assert f"{EVIL} reward" in page.texts[".chart-title"]
    kv = page.kv()
    assert kv["policy.model_name"] == kv["data.path"] == kv["acc/" + EVIL] == EVIL
    assert kv[EVIL] == "1.5"
    envs_table = page.tables[2]
    assert envs_table[0] == ["task", "environment", "config"]
    assert envs_table[4] == [EVIL, EVIL, f"k={EVIL}"]
    assert f"Environment: {EVIL}" in page.texts["h3"]
    assert f"path: {EVIL}" in page.texts[".code"][0]  # the full config.yaml
    visible = "".join(page.texts["body"]) + page.texts["title"][0]
    # title, h1, subtitle, tile, headline note, task table (task, environment), chart title,
    # 2 highlights, environments table (3 cells), config.yaml (5 lines), 4 metric texts
    assert html.count(EVIL_HTML) == visible.count(EVIL) == 22  # and no unescaped copy
    data = strict_json(page.scripts[0])
    assert not set("<>&") & set(page.scripts[0])
    assert data["samples"][7]["task"] == EVIL
    assert data["samples"][0]["messages"][0]["content"] == EVIL
    assert list(data["colors"]) == ["math", "sliding_puzzle", "preference", EVIL]


def test_template_variables_are_exactly_the_context_and_a_missing_one_is_an_error():
    context = report_context(fixture_records(), fixture_config(), None, "run")
    source = environment().loader.get_source(environment(), TEMPLATE)[0]
    assert meta.find_undeclared_variables(environment().parse(source)) == set(context)
    del context["title"]
    with pytest.raises(jinja2.UndefinedError, match="'title' is undefined"):
        render(TEMPLATE, **context)


def test_css_and_js_are_inlined_verbatim(report):
    page = Page(report[1])
    assets = resources.files("envloop.report") / "assets"
    assert page.texts["style"] == [(assets / "report.css").read_text("utf-8").strip()]
    assert page.scripts[1] == (assets / "report.js").read_text("utf-8")


def test_headline_gives_per_task_means_when_reward_scales_differ(report):
    page = Page(report[1])  # preference's raw scores (-0.375) beside 0/1 math and puzzle
    labels = [label for label, _, _ in page.tiles()]
    assert labels == ["samples", "math", "sliding_puzzle", "preference", "mean turns",
                      "mean tokens", "truncated", "env errors", "wall time"]  # fmt: skip
    assert page.texts[".kpis-note"] == [
        "No mean reward over all tasks: the rewards of preference lie outside [0, 1], so the "
        "tasks' reward scales may differ; each task's mean is shown on its own."
    ]


def test_headline_gives_an_overall_mean_when_every_reward_lies_in_0_1(tmp_path):
    run = write_run_dir(tmp_path / "unit", rm_rewards=(0.8125, 0.25))
    page = Page(build_report(run).read_text(encoding="utf-8"))
    assert page.tiles()[1:5] == [
        ("mean reward", "0.5078", "all tasks, every reward in [0, 1] · min 0 · max 1"),
        ("math", "0.5", "mean reward · min 0 · max 1"),
        ("sliding_puzzle", "0.5", "mean reward · min 0 · max 1"),
        ("preference", "0.5312", "mean reward · min 0.25 · max 0.8125"),
    ]  # (1 + 1 + 1 + 0.8125 + 0.25) / 8 = 0.5078
    assert page.tiles()[5][0] == "mean turns" and ".kpis-note" not in page.texts


def test_headline_of_one_task_is_its_mean_whatever_its_scale(tmp_path):
    records = [r for r in fixture_records(rm_rewards=(8.5, -1.5)) if r["task"] == "preference"]
    page = Page(build_report(write_run_dir(tmp_path / "rm", records=records)).read_text())
    assert page.tiles()[:2] == [
        ("samples", "2", "1 task"),
        ("preference", "3.5", "mean reward · min -1.5 · max 8.5"),
    ]
    assert ".kpis-note" not in page.texts


def test_off_scale_tasks_reads_the_demo_as_mixed():
    demo = {"math": [0.0, 1.0, 1.0], "sliding_puzzle": [1.0], "reward_model": [8.0, -1.3]}
    assert off_scale_tasks(demo) == ["reward_model"]
    assert off_scale_tasks({"math": [0.0, 1.0], "sliding_puzzle": [1.0, 0.0]}) == []
    assert off_scale_tasks({"a": [1.0], "b": [1.5], "c": [-0.01]}) == ["b", "c"]
    assert off_scale_tasks({"a": [float("nan")], "b": [float("inf")]}) == ["b"]


def test_trajectory_data_keeps_every_turn(report):
    data = strict_json(Page(report[1]).scripts[0])
    records = fixture_records()
    assert [s["sample"] for s in data["samples"]] == list(range(8))
    puzzle = data["samples"][4]
    assert [m["role"] for m in puzzle["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert [m["reward"] for m in puzzle["messages"]] == [None, None, 0.0, None, 1.0]
    assert puzzle["tokens"] == sum(m["num_tokens"] for m in records[4]["messages"]) == 137
    assert data["samples"][5]["error"] == records[5]["error"]


def test_a_run_directory_from_before_policy_model_name_shows_its_model(tmp_path):
    run = write_run_dir(tmp_path / "old")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["policy"]["model"] = config["policy"].pop("model_name")  # the config's old key
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    page = Page(build_report(run).read_text(encoding="utf-8"))
    assert page.texts[".subtitle"] == ["8 samples · 3 tasks · policy bundled:policy"]
    assert page.kv()["policy.model"] == "bundled:policy" and "policy.model_name" not in page.kv()


def test_report_without_config_or_metrics(tmp_path):
    run = write_run_dir(tmp_path / "run")
    (run / "config.yaml").unlink()
    (run / "metrics.json").unlink()
    html = build_report(run).read_text(encoding="utf-8")
    assert "config.yaml not found in the run directory." in html
    assert "metrics.json not found in the run directory." in html
    assert html.count('<svg class="hist"') == 6


def test_non_finite_and_empty_runs_still_give_valid_pages(tmp_path):
    records = fixture_records()
    records[0]["total_reward"] = float("nan")
    records[1]["total_reward"] = None  # how a JSON writer may store NaN
    data = strict_json(Page(render_report(records, None, None, "nan")).scripts[0])
    assert data["samples"][0]["total_reward"] == "nan"
    assert data["samples"][1]["total_reward"] is None
    run = write_run_dir(tmp_path / "empty", records=[])
    html = build_report(run).read_text(encoding="utf-8")
    assert strict_json(Page(html).scripts[0]) == {"colors": {}, "samples": []}


def test_missing_run_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="No run directory at .*nowhere"):
        build_report(tmp_path / "nowhere")
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="rollouts.jsonl does not exist"):
        build_report(tmp_path / "run")


@needs_chromium
@pytest.mark.slow
def test_chromium_renders_the_report(report, tmp_path):
    image = read_png(screenshot(report[0], tmp_path / "report.png", 1280, 2600))
    assert image.size == (1280, 2600)
    assert image.distinct_colors() > 500  # text, charts and badges, not a blank page
    assert image.mean_brightness((0, 0, 1280, 90)) < 90  # the dark header band
    tiles = image.crop((40, 130, 1240, 280))
    assert (tiles.max(axis=-1) < 100).sum() > 500  # KPI numbers drawn in dark text
    for color in [*PALETTE[:3], TURNS_COLOR, TOKENS_COLOR]:
        rgb = (int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16))
        assert image.count(rgb) > 300, f"no bars drawn in {color}"
    # green reward pills of the trajectory rows, which the page's script builds
    assert image.count((0xDC, 0xFA, 0xE6), (0, 1700, 1280, 2600)) > 100


@needs_chromium
@pytest.mark.slow
def test_chromium_runs_the_trajectory_browser(report):
    dom = dump_dom(report[0].as_uri() + "#sample-6")
    body = re.search(r"<body[^>]*>", dom)
    assert body and 'data-ready="1"' in body.group(0) and 'data-rendered="8"' in body.group(0)
    assert re.findall(r'<div class="traj[^"]*" id="sample-(\d+)"', dom) == [
        str(i) for i in range(8)
    ]
    assert re.findall(r'<option value="([^"]+)">', dom)[:3] == [
        "math",
        "sliding_puzzle",
        "preference",
    ]
    expanded = re.findall(r'<div class="traj open" id="sample-(\d+)"', dom)
    assert expanded == ["6"]
    assert "&lt;script&gt;alert('xss')&lt;/script&gt;" in dom
    assert "<script>alert" not in dom
    assert '<span class="msg-reward pill pos">reward 0.8125</span>' in dom
