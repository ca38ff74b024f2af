"""Placement options of the actors envloop starts, on the suite's local Ray session (one
node); where actors land on several nodes: ``tests/integration/test_multi_node.py``."""

from __future__ import annotations

import pytest

from envloop.distributed.ray_utils import SPREAD_MEMORY_BYTES, placement_options
from envloop.environments.registry import create_env

pytestmark = pytest.mark.ray


def test_spread_asks_the_alive_nodes_in_turn_with_a_request_never_empty(ray_session):
    node = ray_session.get_runtime_context().get_node_id()
    first, second = placement_options("spread"), placement_options("spread")
    for options in (first, second):  # one node: every turn asks it
        assert options["scheduling_strategy"].node_id == node
        assert options["scheduling_strategy"].soft is True
        assert options["memory"] == SPREAD_MEMORY_BYTES == 1


def test_a_spread_environment_reserving_no_cpu_starts_and_serves(ray_session):
    # Ray accepts the one byte of memory (its request's only resource) and places the actor
    actor = create_env("math", placement="spread", num_cpus=0)
    try:
        assert ray_session.get(actor.__ray_ready__.remote(), timeout=120)
    finally:
        ray_session.kill(actor)
