"""The summary of a reverify run: status counts, per-task means and the changed samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATUSES = ("same", "changed", "error_fixed", "new_error", "still_error")
"""Per-sample statuses; see :mod:`envloop.report.reverify`."""


def summarize(run_dir: Path, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The reverify summary of the per-sample comparisons ``samples``."""
    changed = [s for s in samples if _is_change(s)]
    per_task: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(s["task"] for s in samples):
        mine = [s for s in samples if s["task"] == task]
        per_task[task] = {
            "num_samples": len(mine),
            "old_mean_reward": sum(s["old_total_reward"] for s in mine) / len(mine),
            "new_mean_reward": sum(s["new_total_reward"] for s in mine) / len(mine),
            "num_changed": sum(_is_change(s) for s in mine),
        }
    return {
        "run_dir": str(run_dir),
        "num_samples": len(samples),
        "num_changed": len(changed),
        "status_counts": {
            status: sum(s["status"] == status for s in samples) for status in STATUSES
        },
        "per_task": per_task,
        "changed": changed,
        "samples": samples,
    }


def _is_change(sample: dict[str, Any]) -> bool:
    return sample["status"] not in ("same", "still_error")


def format_reverify(summary: dict[str, Any], max_listed: int = 20) -> str:
    """The summary as terminal text: counts, a per-task table and the changed samples."""
    counts = ", ".join(f"{k} {v}" for k, v in summary["status_counts"].items())
    samples = f"{summary['num_samples']} sample{'s' * (summary['num_samples'] != 1)}"
    lines = [
        f"Re-verified {samples} of {summary['run_dir']}: "
        f"{summary['num_changed']} changed ({counts}).",
        "",
        f"{'task':<20} {'samples':>7} {'old mean':>9} {'new mean':>9} {'changed':>7}",
    ]
    for task, t in summary["per_task"].items():
        lines.append(
            f"{task:<20} {t['num_samples']:>7} {t['old_mean_reward']:>9.4f} "
            f"{t['new_mean_reward']:>9.4f} {t['num_changed']:>7}"
        )
    if summary["changed"]:
        lines += ["", "Changed samples:"]
    for s in summary["changed"][:max_listed]:
        error = f": {s['new_error'].splitlines()[0]}" if s["new_error"] else ""
        lines.append(
            f"  sample {s['sample']} ({s['task']}): {s['old_total_reward']:.4g} -> "
            f"{s['new_total_reward']:.4g} {s['status']}{error}"
        )
    if len(summary["changed"]) > max_listed:
        lines.append(f"  ... and {len(summary['changed']) - max_listed} more in reverify.json")
    return "\n".join(lines)
