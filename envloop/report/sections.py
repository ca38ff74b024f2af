"""HTML fragments of the run report: summary tiles, tables, config and metrics.

Every value from the run goes through :func:`html.escape` (or :func:`fmt` for numbers), so
text from a run can never become markup.
"""

from __future__ import annotations

from html import escape
from typing import Any

import yaml

CONFIG_HIGHLIGHTS = [
    ("policy", "model"), ("policy", "backend"), ("policy", "temperature"), ("policy", "top_p"),
    ("policy", "max_new_tokens"), ("policy", "seed"), ("data", "path"), ("data", "limit"),
    ("rollout", "max_turns"), ("rollout", "max_seq_len"), ("rollout", "generations_per_prompt"),
    ("rollout", "batch_size"), ("rollout", "observation_format"), ("rollout", "on_env_error"),
]  # fmt: skip
"""The ``(section, key)`` pairs shown at the top of the config card."""


def fmt(value: Any) -> str:
    """A value as report text (escaped): 4 significant digits for floats.

    >>> fmt(2 / 3), fmt(12.5), fmt(1200), fmt(True), fmt(None), fmt(3.0), fmt("<b>")
    ('0.6667', '12.5', '1,200', 'yes', '-', '3', '&lt;b&gt;')
    """
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if value == 0 or 1e-4 <= abs(value) < 1e6 else f"{value:.3e}"
    return "-" if value is None else escape(str(value))


def kpi_tiles(tiles: list[tuple[str, str, str]]) -> str:
    """Summary tiles from ``(label, already formatted value, note)``."""
    cells = "".join(
        f'<div class="kpi"><div class="kpi-value">{value}</div>'
        f'<div class="kpi-label">{escape(label)}</div>'
        f'<div class="kpi-note">{escape(note)}</div></div>'
        for label, value, note in tiles
    )
    return f'<div class="kpis">{cells}</div>'


def table(headers: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    """A table; ``rows`` hold formatted cells; columns from ``numeric_from`` align right."""
    head = "".join(
        f'<th class="{"num" if i >= numeric_from else ""}">{escape(h)}</th>'
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"num" if i >= numeric_from else ""}">{c}</td>' for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def task_badge(task: str, color: str) -> str:
    """A task name with its colour dot (the colour of its charts and trajectories)."""
    return f'<span class="dot" style="background:{color}"></span>{escape(task)}'


def config_section(config: dict[str, Any] | None, colors: dict[str, str]) -> str:
    """Highlights of the resolved config, the environments, and the whole config.yaml."""
    if config is None:
        return '<h2>Config</h2><p class="empty">config.yaml not found in the run directory.</p>'
    rows = [
        f"<tr><th>{escape(section)}.{escape(key)}</th><td>{fmt(config[section][key])}</td></tr>"
        for section, key in CONFIG_HIGHLIGHTS
        if isinstance(config.get(section), dict) and key in config[section]
    ]
    envs = config.get("envs") or {}
    env_rows = [
        [task_badge(task, colors.get(task, "#98a2b3")), fmt(spec.get("name")),
         f"<code>{escape(_compact(spec.get('config')))}</code>"]
        for task, spec in envs.items() if isinstance(spec, dict)
    ]  # fmt: skip
    full = escape(yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return (
        f'<h2>Config</h2><table class="kv">{"".join(rows)}</table>'
        f"<h3>Environments</h3>{table(['task', 'environment', 'config'], env_rows, 3)}"
        f'<details><summary>Full config.yaml</summary><pre class="code">{full}</pre></details>'
    )


def metrics_section(metrics: dict[str, Any] | None) -> str:
    """Rollout metrics, timings and each environment's metrics, as name/value tables."""
    if metrics is None:
        return '<h2>Metrics</h2><p class="empty">metrics.json not found in the run directory.</p>'
    rollout = metrics.get("rollout") or {}
    plain = {k: v for k, v in rollout.items() if not _is_timing(k)}
    timing = {k: v for k, v in rollout.items() if _is_timing(k)}
    if "wall_time_s" in metrics:
        timing = {"wall_time_s": metrics["wall_time_s"], **timing}
    parts = ["<h2>Metrics</h2>", "<h3>Rollout</h3>", _kv_table(plain)]
    for task, env_metrics in (metrics.get("envs") or {}).items():
        parts += [f"<h3>Environment: {escape(task)}</h3>", _kv_table(env_metrics or {})]
    parts += ["<h3>Timing (seconds)</h3>", _kv_table(timing)]
    return "".join(parts)


def _is_timing(key: str) -> bool:
    return key.startswith("timing/") or key.endswith("time_s")


def _kv_table(values: dict[str, Any]) -> str:
    if not values:
        return '<p class="empty">None recorded.</p>'
    rows = "".join(
        f'<tr><th>{escape(str(k))}</th><td class="num">{fmt(v)}</td></tr>'
        for k, v in values.items()
    )
    return f'<table class="kv">{rows}</table>'


def _compact(value: Any) -> str:
    if not value:
        return "defaults"
    return (
        ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)
    )
