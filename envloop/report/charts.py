"""Histograms as inline SVG for the run report: no scripts, no fonts, no network.

:func:`histogram_bins` picks the bars (one per value when there are few distinct values,
one per integer for counts such as turns, else equal-width bins) and :func:`histogram_svg`
draws them with a y axis, count labels and a tooltip (``<title>``) per bar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 420, 210
LEFT, RIGHT, TOP, BOTTOM = 40, 12, 16, 44


@dataclass(frozen=True)
class Bin:
    """One bar: values in ``[lo, hi)`` (the last bin includes ``hi``), or equal to ``lo``
    when ``hi`` is None (a bar per distinct value)."""

    lo: float
    hi: float | None
    count: int


def short(x: float) -> str:
    """A compact tick label.

    >>> short(0.0), short(1.0), short(0.125), short(2500.0), short(-0.3333), short(123.4)
    ('0', '1', '0.125', '2500', '-0.333', '123')
    """
    if x == int(x) or abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def histogram_bins(
    values: Sequence[float], *, integer: bool = False, max_bins: int = 12
) -> list[Bin]:
    """The bars for ``values`` (NaN and infinities left out).

    >>> [(b.lo, b.count) for b in histogram_bins([0.0, 1.0, 1.0])]
    [(0.0, 1), (1.0, 2)]
    >>> [(b.lo, b.count) for b in histogram_bins([1, 3, 3], integer=True)]
    [(1, 1), (2, 0), (3, 2)]
    >>> [(b.lo, b.hi, b.count) for b in histogram_bins([float(i) for i in range(20)], max_bins=4)]
    [(0.0, 4.75, 5), (4.75, 9.5, 5), (9.5, 14.25, 5), (14.25, 19.0, 5)]
    >>> [(b.lo, b.hi, b.count) for b in histogram_bins([10, 25, 49, 50], integer=True, max_bins=4)]
    [(10, 21, 1), (21, 32, 1), (32, 43, 0), (43, 54, 2)]
    """
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return []
    low, high = min(values), max(values)
    if integer and high - low < 30:
        return [Bin(v, None, values.count(v)) for v in range(int(low), int(high) + 1)]
    distinct = sorted(set(values))
    if len(distinct) <= 8 and not integer:
        return [Bin(v, None, values.count(v)) for v in distinct]
    width = math.ceil((high - low + 1) / max_bins) if integer else (high - low) / max_bins
    max_bins = math.ceil((high - low + 1) / width) if integer else max_bins
    counts = [0] * max_bins
    for v in values:
        counts[min(int((v - low) / width), max_bins - 1)] += 1
    return [Bin(low + i * width, low + (i + 1) * width, c) for i, c in enumerate(counts)]


def _nice_top(count: int) -> tuple[int, int]:
    """A y-axis top >= count and a tick step (1, 2, 5 x 10^k) giving at most 5 ticks."""
    count = max(count, 1)
    steps = (m * 10**k for k in range(12) for m in (1, 2, 5))
    step = next(s for s in steps if math.ceil(count / s) <= 4)
    return step * math.ceil(count / step), step


def histogram_svg(bins: list[Bin], *, x_label: str, color: str, unit: str = "samples") -> str:
    """An SVG bar chart of ``bins``; ``x_label`` names the quantity (e.g. "total reward"),
    ``unit`` (a plural ending in "s") what the bars count."""
    if not bins:
        return '<p class="empty">No data.</p>'
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top, step = _nice_top(max(b.count for b in bins))
    slot = plot_w / len(bins)
    parts = [
        f'<svg class="hist" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="histogram of {escape(x_label)}">'
    ]
    for tick in range(0, top + 1, step):
        y = TOP + plot_h - plot_h * tick / top
        parts.append(
            f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        parts.append(f'<text class="ytick" x="{LEFT - 6}" y="{y + 3.5:.1f}">{tick}</text>')
    for i, b in enumerate(bins):
        h, bar_w = plot_h * b.count / top, min(slot * 0.76, 64)
        x, y = LEFT + (i + 0.5) * slot - bar_w / 2, TOP + plot_h - h
        label = short(b.lo) if b.hi is None else f"{short(b.lo)} to {short(b.hi)}"
        tip = f"{escape(x_label)} {label}: {b.count} {escape(unit if b.count != 1 else unit[:-1])}"
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" '
            f'height="{h:.1f}" fill="{color}" rx="2"><title>{tip}</title></rect>'
        )
        if b.count and len(bins) <= 16:
            parts.append(
                f'<text class="count" x="{x + bar_w / 2:.1f}" y="{y - 4:.1f}">{b.count}</text>'
            )
    parts += _x_ticks(bins, slot, TOP + plot_h)
    middle = LEFT + plot_w / 2
    parts.append(
        f'<text class="xlabel" x="{middle:.1f}" y="{HEIGHT - 6}">{escape(x_label)}</text>'
        f'<text class="ylabel" transform="translate(11 {TOP + plot_h / 2:.1f}) rotate(-90)">'
        f"{escape(unit)}</text></svg>"
    )
    return "".join(parts)


def _x_ticks(bins: list[Bin], slot: float, base: float) -> list[str]:
    """Tick labels: bar centres for one-value bars, bin edges (at most ~7) otherwise."""
    if bins[0].hi is None:
        every = max(1, math.ceil(len(bins) / 14))
        ticks = [(LEFT + (i + 0.5) * slot, short(b.lo)) for i, b in enumerate(bins)][::every]
    else:
        edges = [b.lo for b in bins] + [bins[-1].hi or bins[-1].lo]
        every = max(1, math.ceil(len(edges) / 7))
        ticks = [(LEFT + i * slot, short(e)) for i, e in enumerate(edges)][::every]
    line = f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base:.1f}" y2="{base:.1f}"/>'
    return [line] + [
        f'<text class="xtick" x="{x:.1f}" y="{base + 15:.1f}">{t}</text>' for x, t in ticks
    ]
