"""Write the demo dataset, ``examples/demo_data.jsonl``, from :func:`envloop.demo.tasks.demo_rows`.

    .venv/bin/python scripts/write_demo_data.py [--out examples/demo_data.jsonl]

Every row is held out from the bundled models' training; ``tests/unit/demo`` checks that the
committed file is what this writes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from envloop.demo.tasks import demo_rows

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "examples" / "demo_data.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.write_text("".join(json.dumps(row) + "\n" for row in demo_rows()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
