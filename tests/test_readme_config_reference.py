"""The documentation's config reference and rollout options tables are generated from the
config classes, so they cannot drift from the declarations.

``python -m tests.test_readme_config_reference`` rewrites both tables from the declarations.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from envloop.config.declarations import options_table
from envloop.experience.rollout_options import RolloutOptions
from envloop.run.config import config_reference_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
TABLES = {
    "config-reference": (
        "config-reference.md",
        "envloop.run.config.config_reference_table()",
        config_reference_table,
    ),
    "rollout-options": (
        "rollout-semantics.md",
        "envloop.config.declarations.options_table(RolloutOptions)",
        lambda: options_table(RolloutOptions),
    ),
}


def marked(marker: str) -> re.Pattern[str]:
    """The text between a page's ``<!-- marker:start -->`` and ``<!-- marker:end -->`` lines."""
    return re.compile(rf"(<!-- {marker}:start -->\n)(.*?)(\n<!-- {marker}:end -->)", re.S)


def regenerate() -> None:
    """Rewrite each table of the docs from its declarations."""
    for marker, (page, _, generate) in TABLES.items():
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        match = marked(marker).search(text)
        assert match, f"docs/{page} lost its {marker} markers"
        path.write_text(text[: match.start(2)] + generate().strip() + text[match.end(2) :])


@pytest.mark.parametrize("marker", sorted(TABLES))
def test_docs_table_is_in_sync(marker):
    page, source, generate = TABLES[marker]
    text = (DOCS / page).read_text(encoding="utf-8")
    match = marked(marker).search(text)
    assert match, f"docs/{page} lost its {marker} markers"
    assert match.group(2).strip() == generate().strip(), (
        f"docs/{page}: the {marker} table is stale; regenerate it from {source} "
        "(python -m tests.test_readme_config_reference rewrites it)"
    )


if __name__ == "__main__":
    regenerate()
