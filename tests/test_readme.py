"""The README's example runs as written (with a scripted policy standing in for a model)."""

from __future__ import annotations

import re
from pathlib import Path

from envloop.models.generation.scripted_generation import ScriptedGeneration

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tiny_tokenizer):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    replies = iter(["pear", "banana", "an apple!"])
    namespace = {
        "tokenizer": tiny_tokenizer,
        "policy": ScriptedGeneration(tiny_tokenizer, lambda prompt: next(replies)),
    }
    exec(compile(code, str(README), "exec"), namespace)
    final, metrics = namespace["final"], namespace["metrics"]
    assert [m["content"] for m in final["message_log"][0][1:]] == [
        "pear", "try again", "banana", "try again", "an apple!", "yes",
    ]  # fmt: skip
    assert final["total_reward"].tolist() == [1.0]
    assert metrics["total_turns"] == 3
