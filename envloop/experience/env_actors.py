"""Keeping environment actors fit to serve: bounded start-up waits, and no step on an actor
whose step timed out.

Ray cannot stop a synchronous actor task that is running: a step that overran its timeout
keeps its actor busy, and every later call on that actor (readiness probes included) would
queue behind it, for as long as the hang lasts. So when a step times out, the step is
cancelled (Ray then never retries it) and its actor killed with restart allowed: Ray starts a
fresh one behind the same handle when the actor's ``max_restarts`` allows it (actors from
``create_env`` always restart), and the next call waits for that constructor, a wait bounded
by the start-up timeout. An actor that cannot restart stays dead, and its later steps fail
with Ray's error.

Several calls may time out on one stuck actor (calls queued behind the hung one, or steps of
several rollouts at once); only a call sent after the actor's last kill kills it again, so a
fresh actor is never killed for its predecessor's hang.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError

_lock = threading.Lock()
_killed_at: dict[bytes, float] = {}  # actor id -> time.monotonic() of its last kill here


def retire_stuck_actor(actor: Any, call: Any, sent_at: float) -> bool:
    """Cancel ``call`` (an ``ObjectRef`` or streaming generator of ``actor``, sent at
    ``sent_at`` by ``time.monotonic()``) and kill ``actor`` so that it restarts, unless it
    was killed after ``sent_at`` already. Whether this call killed it."""
    ray.cancel(call)
    key = actor._actor_id.binary()
    with _lock:
        if _killed_at.get(key, float("-inf")) >= sent_at:
            return False
        _killed_at[key] = time.monotonic()
    ray.kill(actor, no_restart=False)
    return True


class StartGate:
    """Waits for actors' constructors, each wait bounded by ``timeout_s`` (None: no limit)
    counted from the first time anyone waited for that actor here.

    Once an actor is known started it is never waited for again, except after
    :meth:`forget` (its process died and Ray restarts it).
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._started: set[bytes] = set()
        self._waits: dict[bytes, tuple[Any, float | None]] = {}  # id -> (ready ref, deadline)

    def wait(self, actors: list[Any]) -> set[bytes]:
        """Wait until every actor of ``actors`` has started or its deadline passed; the ids
        (``actor._actor_id.binary()``) of those that did not start in time. A constructor
        that raised counts as started: its error surfaces on the actor's first call."""
        waits = {}
        with self._lock:
            for actor in actors:
                key = actor._actor_id.binary()
                if key in self._started or key in waits:
                    continue
                if key not in self._waits:
                    deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
                    self._waits[key] = (actor.__ray_ready__.remote(), deadline)
                waits[key] = (actor, *self._waits[key])
        late = set()
        for key, (actor, ref, deadline) in waits.items():
            if _ready_by(actor, ref, deadline):
                with self._lock:
                    self._started.add(key)
                    self._waits.pop(key, None)
            else:
                late.add(key)
        return late

    def known_started(self, actor: Any) -> bool:
        """Whether ``actor`` is known started (a :meth:`wait` for it returns at once)."""
        return actor._actor_id.binary() in self._started

    def forget(self, actor: Any) -> None:
        """``actor`` is restarting: the next :meth:`wait` waits for its new constructor, with
        a deadline of its own."""
        key = actor._actor_id.binary()
        with self._lock:
            self._started.discard(key)
            self._waits.pop(key, None)


_PROBE_INTERVAL_S = 0.05


def _ready_by(actor: Any, ref: Any, deadline: float | None) -> bool:
    """Whether ``actor`` answers its readiness probe ``ref`` by ``deadline``; a probe that
    reached the actor while Ray was restarting it is sent again."""
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait([ref], timeout=remaining)
        if not ready:
            return False
        try:
            ray.get(ref)
        except ActorUnavailableError:  # restarting: ask the new actor
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_PROBE_INTERVAL_S)
            ref = actor.__ray_ready__.remote()
            continue
        except RayError:  # dead for good, or its constructor raised: the call will tell
            pass
        return True
