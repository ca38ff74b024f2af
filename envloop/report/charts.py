"""Histograms for the run report, as numbers: ``histogram.svg.j2`` draws them as inline SVG
(no scripts, no fonts, no network).

:func:`histogram_bins` picks the bars (one per value when there are few distinct values,
one per integer for counts such as turns, else equal-width bins) and :func:`histogram`
places them: bar rectangles, y-axis grid lines with their counts, x-axis tick labels and a
tooltip per bar, in the coordinates of a ``WIDTH`` x ``HEIGHT`` view box. Its text (the
axis label, the unit, the tooltips) is plain text, escaped by the template like any other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Bar:
    """One drawn bar: its rectangle (view-box units), its count and its tooltip text."""

    x: float
    y: float
    width: float
    height: float
    count: int
    tip: str


@dataclass(frozen=True)
class Histogram:
    """What ``histogram.svg.j2`` draws; coordinates are view-box units (``WIDTH`` x
    ``HEIGHT``), the plot area spans ``LEFT`` to ``WIDTH - RIGHT`` and ``TOP`` to ``base``."""

    x_label: str  # the quantity on the x axis, e.g. "total reward"
    unit: str  # what the bars count, plural, e.g. "samples"
    color: str  # the bars' fill, a "#rrggbb" colour
    bars: list[Bar]  # empty when there was nothing to count
    y_ticks: list[tuple[float, int]]  # (y, count) of each horizontal grid line
    x_ticks: list[tuple[float, str]]  # (x, label) below the axis
    show_counts: bool  # whether each bar carries its count as a label

    width, height, left, right, top = WIDTH, HEIGHT, LEFT, WIDTH - RIGHT, TOP
    base = TOP + HEIGHT - TOP - BOTTOM  # the x axis's y
    middle = LEFT + (WIDTH - LEFT - RIGHT) / 2  # the x label's x
    y_label_y = TOP + (HEIGHT - TOP - BOTTOM) / 2


def histogram(bins: list[Bin], *, x_label: str, color: str, unit: str = "samples") -> Histogram:
    """``bins`` placed as bars; ``x_label`` names the quantity (e.g. "total reward"),
    ``unit`` (a plural ending in "s") what the bars count.

    >>> h = histogram(histogram_bins([0.0, 1.0, 1.0]), x_label="total reward", color="#000")
    >>> [b.tip for b in h.bars]
    ['total reward 0: 1 sample', 'total reward 1: 2 samples']
    >>> h.y_ticks[-1], h.x_ticks
    ((16.0, 2), [(132.0, '0'), (316.0, '1')])
    """
    if not bins:
        return Histogram(x_label, unit, color, [], [], [], False)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top, step = _nice_top(max(b.count for b in bins))
    slot = plot_w / len(bins)
    y_ticks = [(TOP + plot_h - plot_h * tick / top, tick) for tick in range(0, top + 1, step)]
    bars = []
    for i, b in enumerate(bins):
        h, bar_w = plot_h * b.count / top, min(slot * 0.76, 64)
        label = short(b.lo) if b.hi is None else f"{short(b.lo)} to {short(b.hi)}"
        tip = f"{x_label} {label}: {b.count} {unit if b.count != 1 else unit[:-1]}"
        x, y = LEFT + (i + 0.5) * slot - bar_w / 2, TOP + plot_h - h
        bars.append(Bar(x, y, bar_w, h, b.count, tip))
    return Histogram(x_label, unit, color, bars, y_ticks, _x_ticks(bins, slot), len(bins) <= 16)


def _x_ticks(bins: list[Bin], slot: float) -> list[tuple[float, str]]:
    """Tick labels: bar centres for one-value bars, bin edges (at most ~7) otherwise."""
    if bins[0].hi is None:
        every = max(1, math.ceil(len(bins) / 14))
        return [(LEFT + (i + 0.5) * slot, short(b.lo)) for i, b in enumerate(bins)][::every]
    edges = [b.lo for b in bins] + [bins[-1].hi or bins[-1].lo]
    every = max(1, math.ceil(len(edges) / 7))
    return [(LEFT + i * slot, short(e)) for i, e in enumerate(edges)][::every]
