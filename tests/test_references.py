"""What the package's text cites exists: every dotted ``envloop.<...>`` path in a module's
source (docstrings, comments, strings) names a module of the package, or a name that
module defines; so does every relative cross-reference (``:func:`.math.config.check```,
found as Sphinx finds it: in the module, its package, or as the end of a module's path);
and every section of docs/contract.md cited by name is one of its headings.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "envloop"
CONTRACT = REPO / "docs" / "contract.md"

DOTTED = re.compile(r"(?<![\w/.])envloop(?:\.[A-Za-z_]\w*)+")
RELATIVE = re.compile(r":\w+:`~?\.([A-Za-z_][\w.]*)`")
SECTION = re.compile(r'docs/contract\.md,?\s+"([^"]+)"(?:\s+and\s+"([^"]+)")?')


def modules(root: Path) -> dict[str, Path]:
    """Every module under ``root`` (the ``envloop`` folder) by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def defined_names(tree: ast.Module | ast.ClassDef) -> set[str]:
    """Names a module (or class body) binds at its top level, under ``if``/``try`` too."""
    names = set()
    for node in tree.body:
        for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(sub.name)
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
            elif isinstance(sub, (ast.Assign, ast.AnnAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def unresolved(reference: str, known: dict[str, Path], importable: bool = True) -> str | None:
    """Why ``reference`` (``envloop.a.b`` or ``envloop.a.b.Name[.member]``) names nothing,
    or None when it does. A name is looked up in the module's source first, then (for names
    a package provides on first use) by importing the module, when ``importable``."""
    parts = reference.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if module in known:
            break
    rest = parts[end:]
    if module not in known:
        return f"no module {reference}"
    if not rest or rest[0].startswith("__"):
        return None
    tree = ast.parse(known[module].read_text(encoding="utf-8"))
    if rest[0] not in defined_names(tree):
        if importable and hasattr(importlib.import_module(module), rest[0]):
            return None
        return f"{module} defines no {rest[0]!r}"
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    cls = classes.get(rest[0])
    if len(rest) > 1 and cls is not None and not cls.bases and rest[1] not in defined_names(cls):
        return f"{module}.{rest[0]} defines no {rest[1]!r}"
    return None


def reference_problems(root: Path, importable: bool = True) -> list[str]:
    """Each dotted envloop path, or relative cross-reference, in the modules under ``root``
    that names nothing."""
    known, problems = modules(root), []
    for module, path in known.items():
        where = path.relative_to(root.parent)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOTTED.finditer(line):
                why = unresolved(match.group(0), known, importable)
                if why:
                    problems.append(f"{where}:{number}: {match.group(0)}: {why}")
            for match in RELATIVE.finditer(line):
                if not relative_target(module, path, match.group(1), known, importable):
                    problems.append(f"{where}:{number}: .{match.group(1)}: names nothing")
    return problems


def relative_target(
    module: str, path: Path, reference: str, known: dict[str, Path], importable: bool = True
) -> str | None:
    """What ``.reference`` in ``module`` names: a name in the module, or in its package, or
    a path whose start is the end of some module's path; None when nothing."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    candidates = [f"{module}.{reference}", f"{package}.{reference}"]
    parts = reference.split(".")
    for end in range(len(parts), 0, -1):
        suffix, rest = ".".join(parts[:end]), parts[end:]
        candidates += [".".join([m, *rest]) for m in sorted(known) if m.endswith(f".{suffix}")]
    for candidate in candidates:
        if unresolved(candidate, known, importable) is None:
            return candidate
    return None


def contract_sections(text: str) -> set[str]:
    """The headings of docs/contract.md, without their numbers ("7. Rollout semantics" ->
    "Rollout semantics")."""
    return {
        re.sub(r"^\d+(\.\d+)*\.?\s+", "", line.lstrip("#").strip())
        for line in text.splitlines()
        if line.startswith("#")
    }


def section_problems(root: Path, sections: set[str]) -> list[str]:
    """Each section of docs/contract.md cited by name in the modules under ``root`` that is
    not one of ``sections``."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
        for match in SECTION.finditer(text):
            for name in filter(None, match.groups()):
                if name not in sections:
                    where = path.relative_to(root.parent)
                    problems.append(f"{where}: docs/contract.md has no section {name!r}")
    return problems


def test_every_dotted_envloop_path_in_the_package_names_something():
    assert reference_problems(PACKAGE) == []


def test_every_contract_section_the_package_cites_exists():
    sections = contract_sections(CONTRACT.read_text(encoding="utf-8"))
    assert "Rollout semantics" in sections
    assert section_problems(PACKAGE, sections) == []


def test_a_moved_module_a_missing_name_and_a_missing_section_are_found(tmp_path):
    root = tmp_path / "envloop"
    (root / "environments").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "environments" / "__init__.py").write_text("")
    (root / "environments" / "math.py").write_text(
        '"""Checks: see envloop.environments.math_config and envloop.environments.math.check;\n'
        "scores as envloop.environments.math.Score.value says (docs/contract.md, "
        '"Rollout\n    semantics" and "Rewards").\n"""\n\n'
        "import re\n\n\nclass Score:\n    value: float\n\n\ndef parse(): ...\n"
        "# envloop.environments.math.parse, envloop.environments.math.re and\n"
        "# envloop.environments.math.Score.value, envloop.environments.math.__file__\n"
        "# :func:`.parse`, :class:`~.math.Score`, :mod:`.environments.math` resolve;\n"
        "# :func:`.math_config.check` does not\n"
    )
    assert reference_problems(root, importable=False) == [
        "envloop/environments/math.py:1: envloop.environments.math_config: "
        "envloop.environments defines no 'math_config'",
        "envloop/environments/math.py:1: envloop.environments.math.check: "
        "envloop.environments.math defines no 'check'",
        "envloop/environments/math.py:17: .math_config.check: names nothing",
    ]
    assert section_problems(root, {"Rollout semantics", "Data"}) == [
        "envloop/environments/math.py: docs/contract.md has no section 'Rewards'"
    ]


def test_contract_headings_lose_their_numbers():
    text = "# envloop\n\n## 7. Rollout semantics\nbody # not a heading\n### 7.1 Turns\n"
    assert contract_sections(text) == {"envloop", "Rollout semantics", "Turns"}
