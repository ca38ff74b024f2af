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


def is_actor(obj: Any) -> bool:
    """Whether ``obj`` is a Ray actor handle (rather than an in-process object)."""
    try:
        from ray.actor import ActorHandle
    except ImportError:
        return False
    return isinstance(obj, ActorHandle)
