"""Starting or joining Ray, and calling environments that may be actors or local objects."""

from __future__ import annotations

import itertools
import os
from typing import Any


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    **kwargs: Any,
) -> None:
    """Join the Ray cluster at ``address`` (or ``$RAY_ADDRESS``), or start a local one.

    Safe to call twice: a second call returns without touching the running session.
    A local session starts without the dashboard; ``num_cpus``/``num_gpus`` cap what it
    may use. Extra keyword arguments go to ``ray.init``.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, **kwargs)
        return
    kwargs.setdefault("include_dashboard", False)
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, **kwargs)


PLACEMENTS = ("default", "spread", "resource:<name>")
"""The placements of actors envloop starts (see :func:`placement_options`)."""

_spread_turns = itertools.count()
SPREAD_MEMORY_BYTES = 1
"""The ``memory`` a ``spread`` actor asks for, so that its request is never empty (see
:func:`placement_options`)."""


def check_placement(placement: str) -> str:
    """``placement`` if it is one of :data:`PLACEMENTS`, else a ValueError naming them.

    >>> check_placement("resource:env_nodes")
    'resource:env_nodes'
    >>> check_placement("everywhere")
    Traceback (most recent call last):
    ...
    ValueError: Unknown placement 'everywhere'; use one of default, spread, resource:<name>.
    """
    name = placement.removeprefix("resource:") if isinstance(placement, str) else ""
    if placement in ("default", "spread") or (placement != name and name.strip()):
        return placement
    raise ValueError(f"Unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")


def placement_options(placement: str) -> dict[str, Any]:
    """Ray actor options that place an actor as ``placement`` says.

    - ``"default"``: none; Ray's ``DEFAULT`` scheduling strategy (the driver's node while
      it has free resources, then the least used nodes).
    - ``"spread"``: a soft ``NodeAffinitySchedulingStrategy`` to the next alive node in
      turn (nodes ordered by id, one turn per actor this process places): actors are
      asked of one node after another. Soft: Ray places an actor elsewhere when its node
      lacks the resources or has died. With it goes ``memory=1`` (one byte): Ray's GCS
      hands an actor that asks for no resource at all (``num_cpus=0``, envloop's default
      for environments) to a random node's raylet, which then ignored the soft affinity
      for about half of the actors on a three-node cluster here; an actor asking for
      anything is handed to its owner's raylet, which placed every one where it was
      asked. A ``memory`` of the caller's own replaces it.
    - ``"resource:<name>"``: ``resources={<name>: 0.001}``: only nodes that hold the custom
      resource ``<name>`` (``ray start --resources='{"<name>": 1}'``), e.g. nodes set
      aside for environments; a thousandth of a unit, so any number of actors fit there.

    An actor that Ray restarts (its node died) is placed again on the nodes alive then.
    ``"spread"`` needs Ray running.

    >>> placement_options("default")
    {}
    >>> placement_options("resource:env_nodes")
    {'resources': {'env_nodes': 0.001}}
    """
    check_placement(placement)
    if placement == "default":
        return {}
    if placement == "spread":
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        node_id = nodes[next(_spread_turns) % len(nodes)]
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=True)
        return {"scheduling_strategy": strategy, "memory": SPREAD_MEMORY_BYTES}
    return {"resources": {placement.removeprefix("resource:"): 0.001}}


def is_actor(obj: Any) -> bool:
    """Whether ``obj`` is a Ray actor handle (rather than an in-process object)."""
    try:
        from ray.actor import ActorHandle
    except ImportError:
        return False
    return isinstance(obj, ActorHandle)
