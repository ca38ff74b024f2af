"""Starting or joining Ray, and calling environments that may be actors or local objects."""

from __future__ import annotations

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


def placement_options(placement: str) -> dict[str, Any]:
    """Ray actor options that place an actor as ``placement`` says.

    - ``"default"``: none; Ray's ``DEFAULT`` scheduling strategy (the driver's node while
      it has free resources, then the least used nodes).
    - ``"spread"``: ``scheduling_strategy="SPREAD"``: actors started one after another go
      to different nodes, round robin over the nodes that fit them.
    - ``"resource:<name>"``: ``resources={<name>: 0.001}``: only nodes that hold the custom
      resource ``<name>`` (``ray start --resources='{"<name>": 1}'``), e.g. a node set aside
      for environments; a thousandth of a unit, so any number of actors fit there.

    An actor that Ray restarts (its node died) is placed again the same way, on the nodes
    alive then.

    >>> placement_options("spread")
    {'scheduling_strategy': 'SPREAD'}
    >>> placement_options("resource:env_nodes")
    {'resources': {'env_nodes': 0.001}}
    >>> placement_options("everywhere")
    Traceback (most recent call last):
    ...
    ValueError: Unknown placement 'everywhere'; use one of default, spread, resource:<name>.
    """
    if placement == "default":
        return {}
    if placement == "spread":
        return {"scheduling_strategy": "SPREAD"}
    name = placement.removeprefix("resource:")
    if placement.startswith("resource:") and name.strip():
        return {"resources": {name: 0.001}}
    raise ValueError(f"Unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")


def is_actor(obj: Any) -> bool:
    """Whether ``obj`` is a Ray actor handle (rather than an in-process object)."""
    try:
        from ray.actor import ActorHandle
    except ImportError:
        return False
    return isinstance(obj, ActorHandle)
