"""The suite's own layout: pytest imports test modules by their basename (the test folders
are not packages), so two test files of one name would fail the run at collection."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_name_of_its_own():
    places: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        places[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: sorted(paths) for name, paths in places.items() if len(paths) > 1}
    assert shared == {}, f"rename one of each (e.g. test_<area>_<name>.py): {shared}"
