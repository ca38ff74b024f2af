"""Where ``placement: spread`` puts actors that reserve nothing, with and without the one
byte of ``memory`` it asks for, on a real three-node Ray cluster on this machine.

Each repetition is a fresh driver that places groups of three actors (one per node) with
``num_cpus=0`` (envloop's default for environments), the variants interleaved in one run:
each asked of the next node in turn by a soft ``NodeAffinitySchedulingStrategy`` as
``placement_options("spread")`` gives them (``memory=1``); the same with the ``memory`` left
out; Ray's ``SPREAD`` strategy. It counts the groups that landed on three different nodes
and the actors that landed on the node they were asked of.

    .venv/bin/python benchmarks/spread_placement.py [--repetitions 5] [--groups 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.ray_cluster import driver_output, driver_result, start_cluster, start_driver

_VARIANTS = ("spread (memory=1)", "soft affinity alone", "Ray's SPREAD strategy")

_DRIVER = """
import json
import ray
from envloop.distributed.ray_utils import init_ray, placement_options

init_ray(log_to_driver=False)


@ray.remote
class Where:
    def node(self):
        return ray.get_runtime_context().get_node_id()


variants = {variants!r}
nodes = len([n for n in ray.nodes() if n["Alive"]])
counts = {{v: {{"asked": 0, "groups": 0, "spread_groups": 0}} for v in variants}}
for _ in range({groups}):
    for variant in variants:
        landed = []
        for _ in range(nodes):
            options = placement_options("spread")
            asked = options["scheduling_strategy"].node_id
            if variant != variants[0]:
                options.pop("memory")
            if variant == variants[2]:
                options["scheduling_strategy"] = "SPREAD"
            actor = Where.options(num_cpus=0, **options).remote()
            landed.append(ray.get(actor.node.remote()))
            counts[variant]["asked"] += landed[-1] == asked
            ray.kill(actor)
        counts[variant]["groups"] += 1
        counts[variant]["spread_groups"] += len(set(landed)) == nodes
print("RESULT " + json.dumps(counts))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=5, help="drivers, one after another")
    parser.add_argument("--groups", type=int, default=2, help="groups per variant per driver")
    args = parser.parse_args()
    cluster = start_cluster()
    totals = {v: {"asked": 0, "groups": 0, "spread_groups": 0} for v in _VARIANTS}
    try:
        for rep in range(args.repetitions):
            script = _DRIVER.format(variants=_VARIANTS, groups=args.groups)
            counts = driver_result(driver_output(start_driver(cluster, script)))
            for variant, count in counts.items():
                for key, value in count.items():
                    totals[variant][key] += value
            print(f"repetition {rep + 1}: {json.dumps(counts)}", flush=True)
    finally:
        cluster.stop()
    print(f"\nload average {os.getloadavg()[0]:.1f}")
    print("| num_cpus=0 actors, 3 per group | groups on 3 nodes | actors on the node asked of |")
    print("|---|---|---|")
    for variant, t in totals.items():
        asked = "-" if variant == _VARIANTS[2] else f"{t['asked']} of {3 * t['groups']}"
        print(f"| {variant} | {t['spread_groups']} of {t['groups']} | {asked} |")


if __name__ == "__main__":
    main()
