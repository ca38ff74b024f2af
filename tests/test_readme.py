"""The README's Python blocks run as written, as every page's of the documentation do
(tests/test_docs.py): every ```python block, in order, as one script (as a user pasting them
into one file would), with the bundled policy.

A block preceded by a ``<!-- not run: REASON -->`` line is compiled but not run; a page whose
first lines hold ``<!-- python: continues PAGE -->`` starts from the names PAGE's blocks
defined.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- not run: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
CONTINUES = re.compile(r"^<!-- python: continues (?P<page>\S+) -->$", re.M)


def python_blocks(text: str) -> list[tuple[str | None, str]]:
    """``(reason to skip or None, code)`` for each ```python block of ``text``, in order."""
    return [(m["reason"], m["code"]) for m in BLOCK.finditer(text)]


def continued_page(text: str) -> str | None:
    """The page (relative to docs/) whose namespace a page's blocks continue, or None.

    >>> continued_page("<!-- python: continues getting-started.md -->")
    'getting-started.md'
    >>> continued_page("# Alone") is None
    True
    """
    match = CONTINUES.search(text)
    return match["page"] if match else None


def run_blocks(path: Path, namespace: dict) -> dict:
    """Run ``path``'s blocks in order in ``namespace`` (skipped ones only compiled); returns
    it. A block may ``await`` at its top level, as in ``python -m asyncio``: it then runs in
    an event loop of its own.
    """
    for reason, code in python_blocks(path.read_text(encoding="utf-8")):
        # a skipped block still compiles
        compiled = compile(code, str(path), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        if reason is None and compiled.co_flags & inspect.CO_COROUTINE:
            asyncio.run(eval(compiled, namespace))
        elif reason is None:
            exec(compiled, namespace)
    return namespace


def test_blocks_run_in_order_and_may_await_at_their_top_level(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport asyncio\nx = 1\n```\n"
        "```python\nawait asyncio.sleep(0)\ny = x + 1\n```\n"
        "<!-- not run: illustrative -->\n```python\nz = await undefined()\n```\n"
    )
    namespace = run_blocks(page, {})
    assert (namespace["x"], namespace["y"], "z" in namespace) == (1, 2, False)


def test_python_blocks_are_found_with_their_skip_reasons():
    text = "a\n```python\nx = 1\n```\n<!-- not run: needs the hub -->\n```python\ny\n```\n"
    assert python_blocks(text) == [(None, "x = 1\n"), ("needs the hub", "y\n")]


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(capsys):
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert [reason for reason, _ in blocks] == [None]
    namespace = run_blocks(README, {"__name__": "__main__"})  # as `python script.py` runs it
    assert_rollout_as_the_readme_says(namespace["final"], namespace["metrics"])
    assert capsys.readouterr().out.splitlines()[-1:] == ["[1.0, 1.0] 1.5"]


def assert_rollout_as_the_readme_says(final, metrics):
    """What the README's prose says about the greedy rollout, exactly."""
    contents = [[(m["role"], m["content"]) for m in log[1:]] for log in final["message_log"]]
    assert contents == [
        [("assistant", "2 + 0 = 2, 1 + 3 + 0 = 4, so \\boxed{42}"),
         ("environment", "Environment: correct")],
        [("assistant", "9 + 1 = 10, 0 + 2 + 1 = 2, so \\boxed{20}"),
         ("environment", "Environment: incorrect"),
         ("assistant", "9 + 1 = 10, 0 + 2 + 1 = 3, so \\boxed{30}"),
         ("environment", "Environment: correct")],
    ]  # fmt: skip
    assert final["total_reward"].tolist() == [1.0, 1.0]
    assert [md["tries"] for md in final["extra_env_info"]] == [1, 2]
    assert metrics["total_turns"] == 3 and metrics["natural_termination_rate"] == 1.0
    replies = [m for m in final["message_log"][1] if m["role"] == "assistant"]
    assert [m["generation_logprobs"].shape == m["token_ids"].shape for m in replies] == [True] * 2


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to
    hyphens.

    >>> github_anchor("7. Rollout semantics")
    '7-rollout-semantics'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_the_contract_reach_its_sections():
    contract = ROOT / "docs" / "contract.md"
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", contract.read_text(), re.M)}
    sources = [README, *sorted((ROOT / "envloop").rglob("*.py"))]
    links = [
        (path.name, anchor)
        for path in sources
        for anchor in re.findall(r"docs/contract\.md#([\w-]+)", path.read_text(encoding="utf-8"))
    ]
    assert ("README.md", "7-rollout-semantics") in links
    assert [link for link in links if link[1] not in anchors] == []


def test_check_env_on_the_readme_echo_asks_for_sample_metadata(tmp_path, monkeypatch, capsys):
    from envloop.cli.main import main

    code = python_blocks(README.read_text(encoding="utf-8"))[0][1]
    (tmp_path / "readme_echo.py").write_text(code[: code.index("\npolicy = ")])
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check-env", "readme_echo:Echo"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "FAILED: Echo.step needs sample metadata key 'word', which none of the samples has "
        "(their metadata keys: ground_truth); step raised: KeyError: 'word'. Give samples "
        "whose metadata has 'word'.",
        "check-env stepped its 2 default samples (math answers); pass samples with the "
        "metadata your environment needs: --sample-jsonl FILE, one JSON object per line, e.g. "
        '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
        '"content": "..."}], "metadata": {"word": ...}}',
    ]
    sample = {"messages": [{"role": "user", "content": "What is 12 + 30?"},
                           {"role": "assistant", "content": "\\boxed{42}"}],
              "metadata": {"word": "42", "tries": 0}}  # fmt: skip
    (tmp_path / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    assert (
        main(["check-env", "readme_echo:Echo", "--sample-jsonl", str(tmp_path / "samples.jsonl")])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK: Echo keeps the environment contract on 1 sample")
    assert out[1] == "  sample 0: reward 1; environment: 'Environment: correct'"


def test_readme_is_a_front_page():
    """At most 1,500 words; everything else lives in the documentation pages it links."""
    text = README.read_text(encoding="utf-8")
    assert len(text.split()) <= 1500
    assert "make demo" in text and "make test" in text
    assert re.findall(r"\]\(docs/([\w-]+\.md)", text)  # links into the site


def test_the_demo_tables_are_the_same_in_the_readme_and_getting_started():
    """What the README says ``make demo`` prints is what the getting-started page says."""
    tables = re.compile(r"```\n(task .*?)```", re.S)
    readme = tables.findall(README.read_text(encoding="utf-8"))
    assert len(readme) == 2  # the text demo, then the vision-language demo
    assert readme == tables.findall((ROOT / "docs" / "getting-started.md").read_text())
