"""What the report's config and metrics cards show, as plain text for its templates.

Nothing here writes HTML: values are formatted as text (:func:`fmt`) and the templates
(``envloop/report/assets/*.j2``, autoescaped) turn them into markup.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import yaml

CONFIG_HIGHLIGHTS = [
    ("policy", "model_name"), ("policy", "model"), ("policy", "backend"),
    ("policy", "temperature"), ("policy", "top_p"), ("policy", "max_new_tokens"),
    ("policy", "seed"), ("data", "path"), ("data", "limit"),
    ("rollout", "max_turns"), ("rollout", "max_seq_len"), ("rollout", "generations_per_prompt"),
    ("rollout", "batch_size"), ("rollout", "observation_format"), ("rollout", "on_env_error"),
]  # fmt: skip
"""The ``(section, key)`` pairs shown at the top of the config card (``policy.model`` is
``policy.model_name`` in run directories written before the config had one mechanism)."""

NO_TASK_COLOR = "#98a2b3"
"""The dot of a task the run's samples never mention."""


class TaskRow(NamedTuple):
    """A table row about one task: its name and colour (shown as a dot), then its cells."""

    task: str
    color: str
    cells: list[str]


class ConfigView(NamedTuple):
    """The config card: highlighted ``(dotted key, value)`` pairs, a row per environment
    (environment name, compact config) and the whole config as YAML."""

    highlights: list[tuple[str, str]]
    envs: list[TaskRow]
    yaml: str


class MetricsView(NamedTuple):
    """The metrics card: ``(heading, [(metric name, value)])`` groups, in display order."""

    groups: list[tuple[str, list[tuple[str, str]]]]


def fmt(value: Any) -> str:
    """A value as report text: 4 significant digits for floats (the templates escape it).

    >>> fmt(2 / 3), fmt(12.5), fmt(1200), fmt(True), fmt(None), fmt(3.0), fmt("<b>")
    ('0.6667', '12.5', '1,200', 'yes', '-', '3', '<b>')
    """
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}" if value == 0 or 1e-4 <= abs(value) < 1e6 else f"{value:.3e}"
    return "-" if value is None else str(value)


def config_view(config: dict[str, Any] | None, colors: dict[str, str]) -> ConfigView | None:
    """Highlights of the resolved config, its environments, and the whole config.yaml
    (None without a config).

    >>> view = config_view({"policy": {"seed": 0}, "envs": {"math": {"name": "math"}}}, {})
    >>> view.highlights, view.envs
    ([('policy.seed', '0')], [TaskRow(task='math', color='#98a2b3', cells=['math', 'defaults'])])
    """
    if config is None:
        return None
    highlights = [
        (f"{section}.{key}", fmt(config[section][key]))
        for section, key in CONFIG_HIGHLIGHTS
        if isinstance(config.get(section), dict) and key in config[section]
    ]
    envs = [
        TaskRow(task, colors.get(task, NO_TASK_COLOR),
                [fmt(spec.get("name")), _compact(spec.get("config"))])
        for task, spec in (config.get("envs") or {}).items() if isinstance(spec, dict)
    ]  # fmt: skip
    return ConfigView(highlights, envs, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def metrics_view(metrics: dict[str, Any] | None) -> MetricsView | None:
    """Rollout metrics, each environment's metrics and the timings, as name/value groups
    (None without metrics).

    >>> metrics_view({"rollout": {"truncation_rate": 0.25, "timing/env_step_s": 1.5},
    ...               "envs": {"math": {"math_env/accuracy": 0.5}}, "wall_time_s": 3}).groups
    ... # doctest: +NORMALIZE_WHITESPACE
    [('Rollout', [('truncation_rate', '0.25')]),
     ('Environment: math', [('math_env/accuracy', '0.5')]),
     ('Timing (seconds)', [('wall_time_s', '3'), ('timing/env_step_s', '1.5')])]
    """
    if metrics is None:
        return None
    rollout = metrics.get("rollout") or {}
    timing = {k: v for k, v in rollout.items() if _is_timing(k)}
    if "wall_time_s" in metrics:
        timing = {"wall_time_s": metrics["wall_time_s"], **timing}
    groups = [("Rollout", _pairs({k: v for k, v in rollout.items() if not _is_timing(k)}))]
    groups += [
        (f"Environment: {task}", _pairs(env_metrics or {}))
        for task, env_metrics in (metrics.get("envs") or {}).items()
    ]
    return MetricsView([*groups, ("Timing (seconds)", _pairs(timing))])


def _pairs(values: dict[str, Any]) -> list[tuple[str, str]]:
    return [(str(k), fmt(v)) for k, v in values.items()]


def _is_timing(key: str) -> bool:
    return key.startswith("timing/") or key.endswith("time_s")


def _compact(value: Any) -> str:
    if not value:
        return "defaults"
    return (
        ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)
    )
