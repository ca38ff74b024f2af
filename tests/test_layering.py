"""The package's layers hold: a module imports only from its own part of the package or from
lower layers, and no two parts import each other (read from every module's imports with
``ast``, function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "envloop"

RANKS = {
    "config": 0,  # errors, schema, import paths: used by everything, imports nothing of ours
    "data.packing": 1,  # bin packing (NeMo-RL's path; distributed's sequence packing uses it)
    "distributed": 2,  # BatchedDataDict, sharding, Ray helpers
    "data": 3,  # messages, chat templates, tokenization, datasets
    "models": 4,  # tokenizers, bundled models, generation backends
    "environments": 5,  # the environment interface, registry and built-ins
    "algorithms": 5,  # GRPO building blocks, NeMo-RL's algorithms.utils
    "experience": 6,  # the rollout engine
    "demo": 7,  # the demo's tasks (application: data for the bundled models)
    "integrations": 7,  # adapters for other trainers (TRL), an optional extra
    "agents": 7,  # OpenAI-compatible endpoint and rollouts over agent programs, an extra
    "run": 7,  # the envloop run application
    "report": 8,  # the HTML report and reverify, built from run directories
    "cli": 9,  # the envloop command
}
"""Each part of the package and its layer. A module may import its own part, or a part of
a lower layer; parts of one layer never import each other."""


def part_of(module: str) -> str:
    """The part (a key of RANKS) ``envloop.<...>`` belongs to; "" for ``envloop`` itself."""
    name = module.removeprefix("envloop").removeprefix(".")
    matches = [p for p in RANKS if name == p or name.startswith(p + ".")]
    return max(matches, key=len, default="" if not name else name.split(".")[0])


def module_imports(root: Path) -> dict[str, set[str]]:
    """Every module under ``root`` (the ``envloop`` folder) and the envloop modules it imports."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if parts[-1] == "__init__" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                absolute = (
                    node.module or ""
                    if node.level == 0
                    else ".".join(base + ([node.module] if node.module else []))
                )
                targets.add(absolute)
        found[module] = {t for t in targets if t == "envloop" or t.startswith("envloop.")}
    return found


def layering_problems(root: Path) -> list[str]:
    """Each import that breaks the layers, and each cycle between parts."""
    problems, edges = [], {}
    for module, targets in module_imports(root).items():
        source = part_of(module)
        if source == "":
            problems += [
                f"envloop imports {t}: the package's __init__ imports nothing" for t in targets
            ]
            continue
        if source not in RANKS:
            problems.append(f"{module}: part {source!r} has no layer; add it to RANKS")
            continue
        for target in sorted(targets):
            imported = part_of(target)
            if imported in ("", source):
                continue
            edges.setdefault(source, set()).add(imported)
            if imported not in RANKS or RANKS[imported] >= RANKS[source]:
                problems.append(
                    f"{module} imports {target}: {source} (layer {RANKS[source]}) may import "
                    f"only lower layers, not {imported} (layer {RANKS.get(imported, '?')})"
                )
    return problems + [f"import cycle: {' -> '.join(c)}" for c in _cycles(edges)]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    cycles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycles.append([*path[path.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(edges):
        visit(node, [])
    return cycles


def test_the_package_keeps_its_layers():
    assert layering_problems(PACKAGE) == []


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(m) for m in module_imports(PACKAGE)} - {""}
    assert parts == set(RANKS)


def write(root: Path, module: str, source: str) -> None:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def test_a_planted_violation_and_a_cycle_are_found(tmp_path):
    root = tmp_path / "envloop"
    write(root, "envloop.__init__", "")
    write(root, "envloop.data.datasets", "from envloop.run.config import RunConfig\n")
    write(root, "envloop.run.config", "def f():\n    from envloop.data import datasets\n")
    write(root, "envloop.run.records", "from . import config\nfrom ..cli import main\n")
    write(root, "envloop.cli.main", "import envloop.run.config\n")
    assert layering_problems(root) == [
        "envloop.data.datasets imports envloop.run.config: data (layer 3) may import only "
        "lower layers, not run (layer 7)",
        "envloop.run.records imports envloop.cli: run (layer 7) may import only lower "
        "layers, not cli (layer 9)",
        "import cycle: cli -> run -> cli",
        "import cycle: run -> data -> run",
    ]


def test_relative_imports_resolve_to_their_modules(tmp_path):
    root = tmp_path / "envloop"
    write(root, "envloop.run.__init__", "from .config import x\n")
    write(root, "envloop.run.records", "from . import config\nfrom ..data import datasets\n")
    imports = module_imports(root)
    assert imports["envloop.run"] == {"envloop.run.config"}
    assert imports["envloop.run.records"] == {"envloop.run", "envloop.data"}
