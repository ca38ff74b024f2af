"""What a run directory becomes for people: the HTML report (``page``, with its charts and
sections, and the CSS and JavaScript in ``assets``) and ``envloop reverify`` (re-scoring
stored rollouts with the current environments)."""

from envloop.report.page import build_report, render_report

__all__ = ["build_report", "render_report"]
