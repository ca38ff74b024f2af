"""The documentation site: it builds offline with ``mkdocs build --strict`` (a broken link,
anchor or API reference fails), every page's Python blocks run as written (see
tests/test_readme.py for the conventions), and what the README and the pages cite (dotted
``envloop.<...>`` names, repository files) exists."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from envloop.environments.registry import ENV_REGISTRY
from tests.test_readme import (
    ROOT,
    assert_rollout_as_the_readme_says,
    continued_page,
    python_blocks,
    run_blocks,
)
from tests.test_references import DOTTED, modules, unresolved

DOCS = ROOT / "docs"
PAGES = sorted(
    str(path.relative_to(DOCS))
    for path in DOCS.rglob("*.md")
    if python_blocks(path.read_text(encoding="utf-8"))
)
SERVER = "needs a server listening on 127.0.0.1:8000"
# What the pages of the tutorial print and skip, exactly (other pages: their blocks run).
EXPECTED_OUTPUT = {
    "getting-started.md": ["[1.0, 1.0] 1.5"] * 2,
    # The async rollout, then its groups as they finish: the prompt answered in one turn first.
    "engines.md": ["[1.0, 1.0] 1.5", "[0, 1] [1.0, 1.0]", "[2, 3] [1.0, 1.0]"],
    "generation.md": [
        "['user', 'assistant', 'user', 'assistant', 'user']",
        "[[[1, 6, 4]], [[1, 4, 4]], [[1, 4, 4]]]",
    ],
    # Two groups, one weight update after each.
    "training.md": ["2 2"],
}
EXPECTED_SKIPS = {
    "getting-started.md": [None, None],
    "engines.md": [None],
    "generation.md": [SERVER, None],
    "training.md": [None],
}


def test_the_tutorial_pages_have_python_blocks():
    assert set(EXPECTED_OUTPUT) <= set(PAGES)


@pytest.fixture(scope="module")
def namespaces(ray_session):
    """Each page's namespace after its blocks ran and the lines they printed, computed once;
    a continuing page starts from a copy of its parent's namespace."""
    done: dict[str, tuple[dict, list[str]]] = {}

    def namespace_after(page: str) -> tuple[dict, list[str]]:
        if page not in done:
            text = (DOCS / page).read_text(encoding="utf-8")
            parent = continued_page(text)
            start = dict(namespace_after(parent)[0]) if parent else {"__name__": "__main__"}
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                namespace = run_blocks(DOCS / page, start)
            done[page] = (namespace, printed.getvalue().splitlines())
        return done[page]

    yield namespace_after
    ENV_REGISTRY.pop("echo", None)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("page", PAGES)
def test_page_python_blocks_run_as_written(page, namespaces):
    text = (DOCS / page).read_text(encoding="utf-8")
    if page in EXPECTED_SKIPS:
        assert [reason for reason, _ in python_blocks(text)] == EXPECTED_SKIPS[page]
    parent = continued_page(text)
    assert parent is None or (DOCS / parent).is_file(), f"{page} continues a missing {parent}"
    namespace, printed = namespaces(page)
    if page in EXPECTED_OUTPUT:
        assert printed == EXPECTED_OUTPUT[page]
    if page == "getting-started.md":
        assert_rollout_as_the_readme_says(namespace["final"], namespace["metrics"])


@pytest.mark.slow
def test_site_builds_strictly_offline(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        # not -q: it hides the warnings that --strict counts, and the build passes
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # Every page is in the nav (strict fails on an omitted one), and the API reference is
    # rendered from the docstrings, doctests as code.
    api = (site / "api" / "experience.html").read_text(encoding="utf-8")
    assert "run_multi_turn_rollout" in api and "ExperienceStream" in api
    distributed = (site / "api" / "distributed.html").read_text(encoding="utf-8")
    assert '<span class="gp">&gt;&gt;&gt; </span>' in distributed  # a doctest, highlighted
    assert (site / "config-reference.html").is_file()


def test_doctests_are_fenced_for_the_api_reference():
    spec = importlib.util.spec_from_file_location(
        "doctest_blocks", DOCS / "hooks" / "doctest_blocks.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "Sum.\n\n>>> x[0][1]\n2\n\nMore.\n>>> y\n1"
    assert module.fence_doctests(text) == (
        "Sum.\n\n```pycon\n>>> x[0][1]\n2\n```\n\nMore.\n```pycon\n>>> y\n1\n```"
    )


FILE_PATH = re.compile(
    r"(?<![\w/.-])((?:envloop|tests|scripts|benchmarks|examples|docs)/[\w./*-]*[\w*/])"
)


def cited_problems(path: Path) -> list[str]:
    """Each dotted ``envloop.<...>`` path in ``path`` (a Markdown page) that names nothing, and
    each repository file or folder it cites (``tests/...``, ``scripts/*.py``) that does not
    exist."""
    known, problems = modules(ROOT / "envloop"), []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in DOTTED.finditer(line):
            why = unresolved(match.group(0), known)
            if why:
                problems.append(f"{path.name}:{number}: {match.group(0)}: {why}")
        for match in FILE_PATH.finditer(line):
            cited = match.group(1)
            if not any(ROOT.glob(cited.rstrip("/"))):
                problems.append(f"{path.name}:{number}: {cited}: no such file")
    return problems


@pytest.mark.parametrize(
    "page", ["README.md", *(f"docs/{p.relative_to(DOCS)}" for p in sorted(DOCS.rglob("*.md")))]
)
def test_what_a_page_cites_exists(page):
    assert cited_problems(ROOT / page) == []


def test_a_missing_module_name_and_file_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`envloop.experience.rollouts.run_multi_turn_rollout` in `envloop/experience/`,\n"
        "measured by `benchmarks/*.py`; `envloop.experience.rollout` and `envloop.demo.Nope`\n"
        "in `tests/unit/test_nothing.py`.\n"
    )
    assert cited_problems(page) == [
        "page.md:2: envloop.experience.rollout: envloop.experience defines no 'rollout'",
        "page.md:2: envloop.demo.Nope: envloop.demo defines no 'Nope'",
        "page.md:3: tests/unit/test_nothing.py: no such file",
    ]
