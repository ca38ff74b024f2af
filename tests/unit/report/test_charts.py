"""Histogram bars placed as numbers, and drawn by ``histogram.svg.j2`` exactly."""

from __future__ import annotations

from envloop.report.charts import HEIGHT, histogram, histogram_bins
from envloop.report.templates import render_string

DRAW = '{% from "histogram.svg.j2" import histogram %}{{ histogram(h) }}'


def test_histogram_places_bars_ticks_and_tooltips():
    h = histogram(histogram_bins([1, 3, 3], integer=True), x_label="turns", color="#5c7cfa")
    # plot 368 wide (40 to 408) and 150 high (16 to 166); 3 slots of 122.67, bars 64 wide
    assert [(round(b.x, 2), b.y, b.width, b.height) for b in h.bars] == [
        (69.33, 91.0, 64, 75.0),
        (192.0, 166.0, 64, 0.0),
        (314.67, 16.0, 64, 150.0),
    ]
    assert [(b.count, b.tip) for b in h.bars] == [
        (1, "turns 1: 1 sample"),
        (0, "turns 2: 0 samples"),
        (2, "turns 3: 2 samples"),
    ]
    assert h.y_ticks == [(166.0, 0), (91.0, 1), (16.0, 2)]
    assert [(round(x, 2), label) for x, label in h.x_ticks] == [
        (101.33, "1"),
        (224.0, "2"),
        (346.67, "3"),
    ]
    assert h.base == HEIGHT - 44 == 166


def test_histogram_svg_escapes_its_labels_and_draws_every_bar():
    h = histogram(histogram_bins([0.0, 1.0, 1.0]), x_label="a<b & c", color="#123456")
    svg = render_string(DRAW, h=h)
    assert svg.count('<rect class="bar"') == 2 and svg.count('fill="#123456"') == 2
    assert 'aria-label="histogram of a&lt;b &amp; c"' in svg
    assert "<title>a&lt;b &amp; c 1: 2 samples</title>" in svg
    assert '<text class="xlabel" x="224.0" y="204">a&lt;b &amp; c</text>' in svg
    assert '<text class="count" x="' in svg and "a<b" not in svg


def test_no_data_draws_no_chart():
    h = histogram([], x_label="turns", color="#000000")
    assert (h.bars, h.y_ticks, h.x_ticks) == ([], [], [])
    assert render_string(DRAW, h=h).strip() == '<p class="empty">No data.</p>'
