"""Write the vision demo dataset: ``examples/vlm_demo_data.jsonl`` and its PNG images in
``examples/vlm_demo_images/``, from :func:`envloop.demo.shapes.demo_records`.

    .venv/bin/python scripts/write_vlm_demo_data.py [--out examples/vlm_demo_data.jsonl]

Every row is held out from the bundled VLM policy's training; ``tests/unit/demo`` checks
that the committed files are what this writes. Image paths are relative to the data file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from envloop.demo.shapes import demo_records

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "examples" / "vlm_demo_data.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    records = demo_records()
    for record, image in records:
        path = args.out.parent / record["images"][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, format="PNG", optimize=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record, _ in records))
    print(f"wrote {args.out} and {len(records)} images")


if __name__ == "__main__":
    main()
