"""The async engine's hook for environments that score groups: a prompt's samples reach
such an environment together, once the group's last member has finished generating.

An environment scores groups when it has a ``scores_groups()`` method that returns True (asked
once per rollout, on a thread, the first time one of its samples is ready for it; a Ray
actor is asked remotely). Its samples are grouped as :func:`envloop.environments.groups.prompt_key`
says (one task, the same messages before the first response). :class:`GroupGate` holds each
sample that is ready for such an environment until every other member of its group still in
flight is ready too (a member whose rollout ended before, by failing to generate or
reaching ``max_seq_len``, is not waited for), then releases them all at once, so they share
one environment call (unless the group is larger than ``max_coalesced_samples``). Samples
of other environments pass straight through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from envloop.distributed.ray_utils import is_actor
from envloop.environments.groups import prompt_key

__all__ = ["GroupGate", "scores_groups"]

Key = tuple[str, str]  # (task, prompt key)
STARTUP_TIMEOUT_S = 600.0
"""How long an environment actor is waited for to say whether it scores groups (the
engine's default ``env_startup_timeout_s``)."""


def scores_groups(env: Any, timeout_s: float | None = STARTUP_TIMEOUT_S) -> bool:
    """Whether environment ``env`` (an instance or a Ray actor handle) scores groups: its
    ``scores_groups()`` returns True. An environment without the method, or whose call
    fails or takes over ``timeout_s`` (its actor did not start: its steps will say why),
    does not."""
    method = getattr(env, "scores_groups", None)
    if method is None:
        return False
    try:
        if is_actor(env):
            import ray

            return bool(ray.get(method.remote(), timeout=timeout_s))
        return bool(method())
    except Exception:
        return False


class GroupGate:
    """Holds samples ready for a group-scoring environment until their group is complete
    (see the module docstring). ``release(slot, ended_with_eos)`` sends a sample on to its
    environment; ``state`` is the rollout's state, whose ``task_names`` and ``env_views`` give
    a slot's task and messages. Every method runs on the engine's event loop."""

    def __init__(
        self, task_to_env: dict[str, Any], state: Any, release: Callable[[int, bool], None]
    ) -> None:
        self.task_to_env, self.state, self.release = task_to_env, state, release
        self.groups: dict[str, bool] = {}  # task -> whether its environment scores groups
        self.asked: dict[str, list[tuple[int, bool]]] = {}  # task -> samples awaiting the answer
        self.key_of: dict[int, Key] = {}
        self.members: dict[Key, set[int]] = {}  # in flight
        self.ready: dict[Key, dict[int, bool]] = {}  # slot -> ended_with_eos

    def begin(self, slot: int) -> None:
        """A sample starts in ``slot``: it is a member of its group until :meth:`leave`."""
        key = (self.state.task_names[slot], prompt_key(self.state.env_views[slot]))
        self.key_of[slot] = key
        self.members.setdefault(key, set()).add(slot)

    def arrive(self, slot: int, ended_with_eos: bool) -> None:
        """The sample in ``slot`` is ready for its environment."""
        task = self.state.task_names[slot]
        if task not in self.groups:
            self._ask(task, slot, ended_with_eos)
        elif not self.groups[task] or slot not in self.key_of:
            self.release(slot, ended_with_eos)
        else:
            key = self.key_of[slot]
            self.ready.setdefault(key, {})[slot] = ended_with_eos
            self._release_if_complete(key)

    def leave(self, slot: int) -> None:
        """The sample in ``slot`` ended: its group no longer waits for it."""
        key = self.key_of.pop(slot, None)
        if key is None:
            return
        members = self.members[key]
        members.discard(slot)
        if not members:
            del self.members[key]
        self._release_if_complete(key)

    def _release_if_complete(self, key: Key) -> None:
        ready = self.ready.get(key)
        if ready and ready.keys() >= self.members.get(key, set()):
            del self.ready[key]
            for slot, eos in ready.items():
                self.release(slot, eos)

    def _ask(self, task: str, slot: int, ended_with_eos: bool) -> None:
        """Hold the sample until ``task``'s environment says whether it scores groups."""
        waiting = self.asked.setdefault(task, [])
        waiting.append((slot, ended_with_eos))
        if len(waiting) > 1:
            return
        loop = asyncio.get_running_loop()
        answer = loop.run_in_executor(None, scores_groups, self.task_to_env[task])
        answer.add_done_callback(lambda future: self._answered(task, future))

    def _answered(self, task: str, future: asyncio.Future[bool]) -> None:
        self.groups[task] = (
            not future.cancelled() and future.exception() is None and future.result()
        )
        for slot, eos in self.asked.pop(task, []):
            self.arrive(slot, eos)
