"""A griffe extension for the API reference: each doctest in a docstring (a ``>>>`` line and
the lines up to the next blank one) becomes a fenced ``pycon`` block, so its brackets and
quotes render as code, not as Markdown."""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """``text`` with every run of doctest lines (``>>>`` through the next blank line) fenced.

    >>> print(fence_doctests("Sum.\\n\\n>>> x[0][1]\\n2\\n\\nMore."))
    Sum.
    <BLANKLINE>
    ```pycon
    >>> x[0][1]
    2
    ```
    <BLANKLINE>
    More.
    """
    out: list[str] = []
    in_block = False
    for line in text.splitlines():
        if not in_block and line.lstrip().startswith(">>>"):
            out.append("```pycon")
            in_block = True
        elif in_block and not line.strip():
            out.append("```")
            in_block = False
        out.append(line)
    if in_block:
        out.append("```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctests of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
