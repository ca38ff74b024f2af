"""The run report: one self-contained HTML page built from a run directory.

``report.html`` holds the run summary (tiles, a per-task table, config highlights and every
metric), inline-SVG histograms (reward per task, turns, tokens per sample) and a browsable
list of trajectories (filter by task and outcome, search the text, sort, click to expand
each turn's role, text and reward). CSS and JavaScript are inlined from
``envloop/report/assets``; a Content-Security-Policy forbids every network request, so the
page works offline and shows the same thing everywhere. The trajectories travel as JSON in a
``<script type="application/json">`` block (``<``, ``>`` and ``&`` written as ``\\u003c``
escapes) and are rendered with ``textContent``, so no message text can become markup.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

from envloop.report.charts import histogram_bins, histogram_svg
from envloop.report.sections import (
    config_section,
    fmt,
    kpi_tiles,
    metrics_section,
    table,
    task_badge,
)
from envloop.run.files import load_config, load_metrics, load_rollouts, message_tokens

REPORT_FILE = "report.html"
PALETTE = ["#4263eb", "#e8590c", "#2f9e44", "#c2255c", "#7048e8", "#1098ad", "#f59f00"]
TURNS_COLOR, TOKENS_COLOR, GENERATED_COLOR = "#5c7cfa", "#15aabf", "#82c91e"


def build_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report.html`` from its rollouts (and config and metrics, when present);
    returns the path."""
    run_dir = Path(run_dir)
    records = load_rollouts(run_dir)
    config, metrics = _optional(load_config, run_dir), _optional(load_metrics, run_dir)
    path = run_dir / REPORT_FILE
    path.write_text(render_report(records, config, metrics, run_dir.resolve().name), "utf-8")
    return path


def render_report(
    records: list[dict[str, Any]],
    config: dict[str, Any] | None,
    metrics: dict[str, Any] | None,
    title: str,
) -> str:
    """The report page for ``records`` (rollouts.jsonl objects) as one HTML string."""
    tasks = list(dict.fromkeys(r["task"] for r in records))
    colors = {task: PALETTE[i % len(PALETTE)] for i, task in enumerate(tasks)}
    by_task = {task: [r for r in records if r["task"] == task] for task in tasks}
    model = ((config or {}).get("policy") or {}).get("model")
    values = {
        "title": escape(title),
        "subtitle": escape(
            f"{len(records)} sample{'s' * (len(records) != 1)} · "
            f"{len(tasks)} task{'s' * (len(tasks) != 1)}" + (f" · policy {model}" if model else "")
        ),
        "kpis": kpi_tiles(_kpis(records, metrics, len(tasks))),
        "task_table": _task_table(by_task, colors, config),
        "charts": _charts(records, by_task, colors),
        "config": config_section(config, colors),
        "metrics": metrics_section(metrics),
        "data": _script_json({"colors": colors, "samples": [_trajectory(r) for r in records]}),
        "css": _asset("report.css"),
        "js": _asset("report.js"),
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], _asset("report.html"))


def _kpis(records: list[dict], metrics: dict | None, num_tasks: int) -> list[tuple[str, str, str]]:
    n = max(len(records), 1)
    rewards = [_reward(r) for r in records] or [0.0]
    turns = [r.get("num_turns", 0) for r in records] or [0]
    tokens = [t for t in map(message_tokens, records) if t is not None]
    truncated = sum(bool(r.get("truncated")) for r in records)
    errors = sum(r.get("error") is not None for r in records)
    wall = (metrics or {}).get("wall_time_s")
    return [
        ("samples", fmt(len(records)), f"{num_tasks} task{'s' * (num_tasks != 1)}"),
        (
            "mean reward",
            fmt(sum(rewards) / n),
            f"min {fmt(min(rewards))} · max {fmt(max(rewards))}",
        ),
        ("mean turns", fmt(sum(turns) / n), f"max {max(turns)}"),
        ("mean tokens", fmt(sum(tokens) / len(tokens)) if tokens else "-", "per sample"),
        ("truncated", fmt(truncated), f"{100 * truncated / n:.0f}% of samples"),
        ("env errors", fmt(errors), f"{100 * errors / n:.0f}% of samples"),
        ("wall time", f"{fmt(wall)} s" if wall is not None else "-", "whole run"),
    ]


def _task_table(by_task: dict[str, list[dict]], colors: dict[str, str], config: dict | None) -> str:
    envs = (config or {}).get("envs") or {}
    rows = []
    for task, records in by_task.items():
        rewards = [_reward(r) for r in records]
        tokens = [t for t in map(message_tokens, records) if t is not None]
        rows.append([
            task_badge(task, colors[task]), fmt((envs.get(task) or {}).get("name")),
            fmt(len(records)), fmt(sum(rewards) / len(rewards)), fmt(min(rewards)),
            fmt(max(rewards)), f"{100 * sum(x > 0 for x in rewards) / len(rewards):.0f}%",
            fmt(sum(r.get("num_turns", 0) for r in records) / len(records)),
            fmt(sum(tokens) / len(tokens)) if tokens else "-",
            fmt(sum(bool(r.get("truncated")) for r in records)),
            fmt(sum(r.get("error") is not None for r in records)),
        ])  # fmt: skip
    headers = ["task", "environment", "samples", "mean reward", "min", "max", "reward > 0",
               "mean turns", "mean tokens", "truncated", "errors"]  # fmt: skip
    return table(headers, rows, numeric_from=2)


def _charts(records: list[dict], by_task: dict[str, list[dict]], colors: dict[str, str]) -> str:
    cards = []
    for task, mine in by_task.items():
        rewards = [_reward(r) for r in mine]
        note = f"n = {len(rewards)} · mean {fmt(sum(rewards) / len(rewards))}"
        svg = histogram_svg(histogram_bins(rewards), x_label="total reward", color=colors[task])
        cards.append(_card(f"{task_badge(task, colors[task])} reward", note, svg))
    turns = [int(r.get("num_turns", 0)) for r in records]
    tokens = [t for t in map(message_tokens, records) if t is not None]
    generated = [_generated_tokens(r) for r in records]
    for title, values, color, label, integer in [
        ("Turns per sample", turns, TURNS_COLOR, "turns", True),
        ("Tokens per sample", tokens, TOKENS_COLOR, "tokens, all messages", True),
        ("Generated tokens per sample", generated, GENERATED_COLOR, "assistant tokens", True),
    ]:  # fmt: skip
        note = f"n = {len(values)} · mean {fmt(sum(values) / len(values))}" if values else ""
        svg = histogram_svg(histogram_bins(values, integer=integer), x_label=label, color=color)
        cards.append(_card(escape(title), note, svg))
    return "".join(cards)


def _card(title_html: str, note: str, svg: str) -> str:
    return (
        f'<figure class="chart"><figcaption><span class="chart-title">{title_html}</span>'
        f'<span class="chart-note">{escape(note)}</span></figcaption>{svg}</figure>'
    )


def _reward(record: dict[str, Any]) -> float:
    """A sample's total reward; NaN when missing or stored as null (JSON's NaN)."""
    value = record.get("total_reward")
    return math.nan if value is None else float(value)


def _generated_tokens(record: dict[str, Any]) -> int:
    return sum(
        m.get("num_tokens") or 0 for m in record.get("messages", []) if m.get("role") == "assistant"
    )


def _trajectory(record: dict[str, Any]) -> dict[str, Any]:
    """What the page's script shows of one sample."""
    keys = ["sample", "idx", "generation", "task", "total_reward", "rewards", "num_turns"]
    keys += ["truncated", "terminated", "error", "ground_truth"]
    messages = [
        {k: m.get(k) for k in ("role", "content", "num_tokens", "reward")}
        for m in record.get("messages", [])
    ]
    return {
        **{k: record.get(k) for k in keys},
        "tokens": message_tokens(record),
        "messages": messages,
    }


def _script_json(value: Any) -> str:
    """JSON safe inside ``<script>``: no ``<``, ``>`` or ``&`` survives literally."""
    text = json.dumps(_finite(value), ensure_ascii=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as strings (JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _asset(name: str) -> str:
    return (resources.files("envloop.report") / "assets" / name).read_text(encoding="utf-8")


def _optional(load: Callable[[Path], dict[str, Any]], run_dir: Path) -> dict[str, Any] | None:
    try:
        return load(run_dir)
    except FileNotFoundError:
        return None
