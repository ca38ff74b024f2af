"""The package's layers hold: a module imports only from its own part of the package or from
lower layers, and nothing imports in a cycle: not two parts of the package, not two
sub-packages or modules of one package (read from every module's imports with ``ast``,
function-level and type-checking imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "envloop"

RANKS = {
    "config": 0,  # errors, schema, import paths: used by everything, imports nothing of ours
    "distributed": 1,  # BatchedDataDict, sharding and its bin packing, Ray helpers
    "data": 2,  # messages, chat templates, tokenization, datasets, NeMo-RL's packer classes
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
    """Every module under ``root`` (the ``envloop`` folder) and the envloop modules it imports
    (``from package import module`` counts as importing that module)."""
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
                for alias in node.names:
                    child = f"{absolute}.{alias.name}"
                    targets.add(child if child in paths else absolute)
        found[module] = {t for t in targets if t == "envloop" or t.startswith("envloop.")}
    return found


def layering_problems(root: Path) -> list[str]:
    """Each import that breaks the layers."""
    problems = []
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
            if imported not in RANKS or RANKS[imported] >= RANKS[source]:
                problems.append(
                    f"{module} imports {target}: {source} (layer {RANKS[source]}) may import "
                    f"only lower layers, not {imported} (layer {RANKS.get(imported, '?')})"
                )
    return problems


def import_cycles(root: Path) -> list[str]:
    """Each import cycle among the members (modules and sub-packages) of one package, for
    every package under ``root``: ``envloop``'s parts, the sub-packages of a part, the modules
    of a folder. A package's own ``__init__`` is not a member (it may gather its members)."""
    imports = module_imports(root)
    packages = sorted(m for m in imports if _is_package(root, m))
    found = []
    for package in packages:
        edges: dict[str, set[str]] = {}
        for module, targets in imports.items():
            source = _member(package, module)
            for target in targets:
                imported = _member(package, target)
                if source and imported and imported != source:
                    edges.setdefault(source, set()).add(imported)
        found += [f"import cycle in {package}: {' -> '.join(c)}" for c in _cycles(edges)]
    return found


def _is_package(root: Path, module: str) -> bool:
    return root.parent.joinpath(*module.split("."), "__init__.py").is_file()


def _member(package: str, module: str) -> str:
    """The member of ``package`` that ``module`` is or lies in ("" if outside or the package)."""
    if not module.startswith(package + "."):
        return ""
    return module[len(package) + 1 :].split(".")[0]


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


def test_nothing_in_the_package_imports_in_a_cycle():
    assert import_cycles(PACKAGE) == []


def test_every_part_of_the_package_has_a_layer():
    parts = {part_of(m) for m in module_imports(PACKAGE)} - {""}
    assert parts == set(RANKS)


def write(root: Path, module: str, source: str) -> None:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def planted(tmp_path: Path) -> Path:
    root = tmp_path / "envloop"
    for package in ("envloop", "envloop.data", "envloop.run", "envloop.cli"):
        write(root, f"{package}.__init__", "")
    write(root, "envloop.data.datasets", "from envloop.run.config import RunConfig\n")
    write(root, "envloop.run.config", "def f():\n    from envloop.data import datasets\n")
    write(root, "envloop.run.records", "from . import config\nfrom ..cli import main\n")
    write(root, "envloop.cli.main", "import envloop.run.config\n")
    return root


def test_a_planted_violation_is_found(tmp_path):
    assert layering_problems(planted(tmp_path)) == [
        "envloop.data.datasets imports envloop.run.config: data (layer 2) may import only "
        "lower layers, not run (layer 7)",
        "envloop.run.records imports envloop.cli.main: run (layer 7) may import only lower "
        "layers, not cli (layer 9)",
    ]


def test_planted_cycles_between_parts_are_found(tmp_path):
    assert import_cycles(planted(tmp_path)) == [
        "import cycle in envloop: cli -> run -> cli",
        "import cycle in envloop: run -> data -> run",
    ]


def test_a_cycle_between_two_modules_is_found_even_for_type_checking(tmp_path):
    root = planted(tmp_path)
    write(root, "envloop.run.state", "from envloop.run.metrics import Timer\n")
    write(
        root,
        "envloop.run.metrics",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import state\n",
    )
    assert "import cycle in envloop.run: metrics -> state -> metrics" in import_cycles(root)


def test_cycles_between_sub_packages_of_a_part_are_found(tmp_path):
    root = tmp_path / "envloop"
    for package in ("envloop", "envloop.env", "envloop.env.vlm"):
        write(root, f"{package}.__init__", "")
    write(root, "envloop.env.rewards", "from envloop.env.vlm.scores import score\n")
    write(root, "envloop.env.vlm.scores", "from envloop.env.rewards import REWARDS\n")
    write(root, "envloop.env.vlm.env", "from envloop.env.vlm import scores\n")
    assert import_cycles(root) == ["import cycle in envloop.env: rewards -> vlm -> rewards"]


def test_a_package_init_gathering_its_members_is_no_cycle(tmp_path):
    root = tmp_path / "envloop"
    write(root, "envloop.__init__", "")
    write(root, "envloop.data.__init__", "from envloop.data.tokens import tokenize\n")
    write(root, "envloop.data.tokens", "from envloop.data.text import clean\n")
    write(root, "envloop.data.text", "")
    assert import_cycles(root) == []


def test_relative_imports_resolve_to_their_modules(tmp_path):
    root = tmp_path / "envloop"
    write(root, "envloop.run.__init__", "from .config import x\n")
    write(root, "envloop.run.records", "from . import config\nfrom ..data import datasets\n")
    imports = module_imports(root)
    assert imports["envloop.run"] == {"envloop.run.config"}
    assert imports["envloop.run.records"] == {"envloop.run", "envloop.data"}
