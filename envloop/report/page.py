"""The run report: one self-contained HTML page built from a run directory.

``report.html`` holds the run summary (tiles, a per-task table, config highlights and every
metric), inline-SVG histograms (reward per task, turns, tokens per sample) and a browsable
list of trajectories (filter by task and outcome, search the text, sort, click to expand
each turn's role, text and reward, with a message's images as thumbnails where its image
parts stand: :mod:`envloop.report.thumbnails`). The headline gives each task's mean
reward, and a mean over all tasks only when their rewards share a scale
(:func:`off_scale_tasks`).

This module gathers what the page shows as plain text and numbers (:func:`report_context`);
the jinja2 templates of ``envloop/report/assets`` (``report.html.j2``, ``sections.html.j2``,
``histogram.svg.j2``) write the HTML, autoescaped, so every text from a run is escaped by
jinja2 (see :mod:`envloop.report.templates`). CSS and JavaScript are inlined from the same
folder; a Content-Security-Policy forbids every network request, so the page works offline
and shows the same thing everywhere. The trajectories travel as JSON in a
``<script type="application/json">`` block (jinja2's ``tojson``: ``<``, ``>``, ``&`` and
``'`` written as ``\\u003c`` escapes) and the page's script renders them with
``textContent``, so no message text can become markup. Thumbnails travel in the same
block as ``data:`` URIs that this package encoded (the policy allows images from ``data:``
only), set as an ``<img>``'s ``src``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from envloop.data.multimodal_utils import content_text_parts
from envloop.report.charts import Histogram, histogram, histogram_bins
from envloop.report.sections import TaskRow, config_view, fmt, metrics_view
from envloop.report.templates import render
from envloop.report.thumbnails import Thumbnails
from envloop.run.files import load_config, load_metrics, load_rollouts, message_tokens
from envloop.run.metrics import on_unit_scale

REPORT_FILE = "report.html"
TEMPLATE = "report.html.j2"
PALETTE = ["#4263eb", "#e8590c", "#2f9e44", "#c2255c", "#7048e8", "#1098ad", "#f59f00"]
TURNS_COLOR, TOKENS_COLOR, GENERATED_COLOR = "#5c7cfa", "#15aabf", "#82c91e"


class Tile(NamedTuple):
    """A headline figure: its value, what it is and a note, all plain text. A task's tile
    carries the task's colour (shown as a dot) and has the task's name as its label."""

    value: str
    label: str
    note: str
    color: str | None = None


class Card(NamedTuple):
    """A chart with its title and note; a task's chart carries the task's colour."""

    title: str
    note: str
    chart: Histogram
    color: str | None = None


def build_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report.html`` from its rollouts (and config and metrics, when present);
    returns the path."""
    run_dir = Path(run_dir)
    records = load_rollouts(run_dir)
    config, metrics = _optional(load_config, run_dir), _optional(load_metrics, run_dir)
    path = run_dir / REPORT_FILE
    html = render_report(records, config, metrics, run_dir.resolve().name, run_dir=run_dir)
    path.write_text(html, "utf-8")
    return path


def render_report(
    records: list[dict[str, Any]],
    config: dict[str, Any] | None,
    metrics: dict[str, Any] | None,
    title: str,
    run_dir: str | Path | None = None,
) -> str:
    """The report page for ``records`` (rollouts.jsonl objects) as one HTML string; the
    image files their messages name are read from ``run_dir`` (without it, images are
    shown by name only)."""
    return render(TEMPLATE, **report_context(records, config, metrics, title, run_dir))


def report_context(
    records: list[dict[str, Any]],
    config: dict[str, Any] | None,
    metrics: dict[str, Any] | None,
    title: str,
    run_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Every variable the page's template uses, as plain text, numbers and named tuples."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    colors = {task: PALETTE[i % len(PALETTE)] for i, task in enumerate(tasks)}
    by_task = {task: [r for r in records if r["task"] == task] for task in tasks}
    policy = (config or {}).get("policy") or {}
    model = policy.get("model_name") or policy.get("model")  # "model": older run directories
    tiles, tiles_note = _headline(records, by_task, colors, metrics)
    thumbnails = Thumbnails(run_dir)
    data: dict[str, Any] = {
        "colors": colors,
        "samples": [_trajectory(r, thumbnails) for r in records],
    }
    if thumbnails.images:
        data["images"] = thumbnails.images
    return {
        "title": title,
        "subtitle": f"{_plural(len(records), 'sample')} · {_plural(len(tasks), 'task')}"
        + (f" · policy {model}" if model else ""),
        "tiles": tiles,
        "tiles_note": tiles_note,
        "task_headers": TASK_HEADERS,
        "task_rows": [
            _task_row(task, colors[task], mine, config) for task, mine in by_task.items()
        ],
        "charts": _charts(records, by_task, colors),
        "config": config_view(config, colors),
        "metrics": metrics_view(metrics),
        "images_note": thumbnails.note(),
        "data": _finite(data),
    }


def off_scale_tasks(rewards: Mapping[str, Sequence[float]]) -> list[str]:
    """The tasks (keys of ``rewards``, each task's sample rewards) with a reward outside
    [0, 1].

    The headline averages rewards across tasks only when there are several tasks and this
    is empty. Rewards in [0, 1] are success-like scores (pass or fail, solve rates, graded
    fractions), so their mean over all samples is a success rate. A task with a reward
    outside [0, 1] (a reward model's raw scores, penalties, bonuses) has a scale of its
    own, and averaging it with other tasks gives a number neither scale can read (the
    demo's 0/1 math rewards and raw reward-model scores average to 2.692). NaN (a missing
    reward) says nothing about the scale and is left out.

    >>> off_scale_tasks({"math": [0.0, 1.0], "puzzle": [1.0, -0.1], "rm": [8.0, math.inf]})
    ['puzzle', 'rm']
    >>> off_scale_tasks({"math": [0.0, 1.0], "graded": [0.25, math.nan]})
    []
    """
    return [task for task, values in rewards.items() if not on_unit_scale(values)]


def _headline(
    records: list[dict],
    by_task: dict[str, list[dict]],
    colors: dict[str, str],
    metrics: dict | None,
) -> tuple[list[Tile], str]:
    """The summary tiles, and a line saying why no overall mean reward is shown (or "")."""
    rewards = {task: [_reward(r) for r in mine] for task, mine in by_task.items()}
    turns = [r.get("num_turns", 0) for r in records]
    tokens = [t for t in map(message_tokens, records) if t is not None]
    n = max(len(records), 1)
    truncated = sum(bool(r.get("truncated")) for r in records)
    errors = sum(r.get("error") is not None for r in records)
    wall = (metrics or {}).get("wall_time_s")
    reward_tiles, note = _reward_tiles(rewards, colors)
    tiles = [
        Tile(fmt(len(records)), "samples", _plural(len(by_task), "task")),
        *reward_tiles,
        Tile(fmt(sum(turns) / n), "mean turns", f"max {max(turns, default=0)}"),
        Tile(fmt(_mean(tokens)) if tokens else "-", "mean tokens", "per sample"),
        *([_versions_tile(records)] if any("min_policy_version" in r for r in records) else []),
        Tile(fmt(truncated), "truncated", f"{100 * truncated / n:.0f}% of samples"),
        Tile(fmt(errors), "env errors", f"{100 * errors / n:.0f}% of samples"),
        Tile(f"{fmt(wall)} s" if wall is not None else "-", "wall time", "whole run"),
    ]
    return tiles, note


def _versions_tile(records: list[dict]) -> Tile:
    """The spread of policy versions that generated the run's tokens (shown for records
    that carry ``min_policy_version`` / ``max_policy_version``).

    >>> _versions_tile([{"min_policy_version": 2, "max_policy_version": 4},
    ...                 {"min_policy_version": 3, "max_policy_version": 3}])
    Tile(value='2-4', label='policy versions', note='at most 2 within a sample', color=None)
    """
    spans = [
        (r["min_policy_version"], r.get("max_policy_version", r["min_policy_version"]))
        for r in records
        if r.get("min_policy_version", -1) >= 0
    ]
    if not spans:
        return Tile("-", "policy versions", "no generated token")
    low, high = min(lo for lo, _ in spans), max(hi for _, hi in spans)
    if low == high:
        return Tile(str(low), "policy version", "of every generated token")
    widest = max(hi - lo for lo, hi in spans)
    return Tile(f"{low}-{high}", "policy versions", f"at most {widest} within a sample")


def _reward_tiles(
    rewards: dict[str, list[float]], colors: dict[str, str]
) -> tuple[list[Tile], str]:
    """A mean-reward tile per task, preceded by one for all tasks when there are several
    and their rewards share a scale (see :func:`off_scale_tasks`); else a line saying why
    there is no overall mean."""
    tiles = [
        Tile(fmt(_mean(values)), task, f"mean reward · {_range(values)}", colors[task])
        for task, values in rewards.items()
    ]
    if len(rewards) < 2:
        return tiles, ""
    off_scale = off_scale_tasks(rewards)
    if off_scale:
        names = ", ".join(off_scale)
        return tiles, (
            f"No mean reward over all tasks: the rewards of {names} lie outside [0, 1], so "
            "the tasks' reward scales may differ; each task's mean is shown on its own."
        )
    every = [x for values in rewards.values() for x in values]
    overall = Tile(
        fmt(_mean(every)), "mean reward", f"all tasks, every reward in [0, 1] · {_range(every)}"
    )
    return [overall, *tiles], ""


TASK_HEADERS = ["task", "environment", "samples", "mean reward", "min", "max", "reward > 0",
                "mean turns", "mean tokens", "truncated", "errors"]  # fmt: skip
"""The task table's columns; from "samples" on they are numbers (aligned right)."""


def _task_row(task: str, color: str, records: list[dict], config: dict | None) -> TaskRow:
    envs = (config or {}).get("envs") or {}
    rewards = [_reward(r) for r in records]
    tokens = [t for t in map(message_tokens, records) if t is not None]
    positive = sum(x > 0 for x in rewards) / len(rewards)
    return TaskRow(task, color, [
        fmt((envs.get(task) or {}).get("name")), fmt(len(records)), fmt(_mean(rewards)),
        fmt(min(rewards)), fmt(max(rewards)), f"{100 * positive:.0f}%",
        fmt(sum(r.get("num_turns", 0) for r in records) / len(records)),
        fmt(_mean(tokens)) if tokens else "-",
        fmt(sum(bool(r.get("truncated")) for r in records)),
        fmt(sum(r.get("error") is not None for r in records)),
    ])  # fmt: skip


def _charts(
    records: list[dict], by_task: dict[str, list[dict]], colors: dict[str, str]
) -> list[Card]:
    cards = []
    for task, mine in by_task.items():
        rewards = [_reward(r) for r in mine]
        note = f"n = {len(rewards)} · mean {fmt(_mean(rewards))}"
        chart = histogram(histogram_bins(rewards), x_label="total reward", color=colors[task])
        cards.append(Card(f"{task} reward", note, chart, colors[task]))
    turns = [int(r.get("num_turns", 0)) for r in records]
    tokens = [t for t in map(message_tokens, records) if t is not None]
    generated = [_generated_tokens(r) for r in records]
    for title, values, color, label in [
        ("Turns per sample", turns, TURNS_COLOR, "turns"),
        ("Tokens per sample", tokens, TOKENS_COLOR, "tokens, all messages"),
        ("Generated tokens per sample", generated, GENERATED_COLOR, "assistant tokens"),
    ]:  # fmt: skip
        note = f"n = {len(values)} · mean {fmt(_mean(values))}" if values else ""
        chart = histogram(histogram_bins(values, integer=True), x_label=label, color=color)
        cards.append(Card(title, note, chart))
    return cards


def _mean(values: Sequence[float]) -> float:
    """The mean (NaN when a value is NaN, or when there is none)."""
    return sum(values) / len(values) if values else math.nan


def _range(values: Sequence[float]) -> str:
    return f"min {fmt(min(values))} · max {fmt(max(values))}" if values else ""


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"


def _reward(record: dict[str, Any]) -> float:
    """A sample's total reward; NaN when missing or stored as null (JSON's NaN)."""
    value = record.get("total_reward")
    return math.nan if value is None else float(value)


def _generated_tokens(record: dict[str, Any]) -> int:
    return sum(
        m.get("num_tokens") or 0 for m in record.get("messages", []) if m.get("role") == "assistant"
    )


def _trajectory(record: dict[str, Any], thumbnails: Thumbnails) -> dict[str, Any]:
    """What the page's script shows of one sample."""
    keys = ["sample", "idx", "generation", "task", "total_reward", "rewards", "num_turns"]
    keys += ["truncated", "terminated", "error", "ground_truth"]
    messages = [_message(m, thumbnails) for m in record.get("messages", [])]
    return {
        **{k: record.get(k) for k in keys},
        "tokens": message_tokens(record),
        "messages": messages,
    }


def _message(message: dict[str, Any], thumbnails: Thumbnails) -> dict[str, Any]:
    """A message as the page shows it: ``content`` as text (what search and previews
    read), and for a content of parts, ``parts``: ``{"text"}`` or an image
    (:meth:`Thumbnails.part`) each, in order."""
    view = {k: message.get(k) for k in ("role", "content", "num_tokens", "reward")}
    content = view["content"]
    if isinstance(content, list):
        view["content"] = content_text_parts(content)
        view["parts"] = [_part(part, thumbnails) for part in content]
    return view


def _part(part: Any, thumbnails: Thumbnails) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image":
        return thumbnails.part(part.get("image"))
    if kind == "text":
        return {"text": str(part.get("text", ""))}
    return {"text": f"[{kind or type(part).__name__} part]"}


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as strings (JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _optional(load: Callable[[Path], dict[str, Any]], run_dir: Path) -> dict[str, Any] | None:
    try:
        return load(run_dir)
    except FileNotFoundError:
        return None
