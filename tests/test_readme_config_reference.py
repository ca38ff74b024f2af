"""The README's config reference table is the one generated from the config models."""

from __future__ import annotations

import re
from pathlib import Path

from envloop.run.config import config_reference_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_in_sync():
    text = README.read_text()
    match = re.search(
        r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", text, re.S
    )
    assert match, "README.md lost its config-reference markers"
    assert match.group(1).strip() == config_reference_table().strip(), (
        "README config reference is stale; regenerate it from "
        "envloop.run.config.config_reference_table()"
    )
