"""What ``run_async_multi_turn_rollout`` returns: a call that works both as NeMo-RL's
function is called and from inside an event loop.

NeMo-RL's ``run_async_multi_turn_rollout`` is a plain function that runs its own event loop
and returns ``(final_batch, metrics)``, so ported code writes
``final, metrics = run_async_multi_turn_rollout(...)``. Code already inside an event loop
cannot block on one, so it writes ``await run_async_multi_turn_rollout(...)`` (or hands the
call to ``asyncio.run``). :class:`RolloutCall` is a coroutine that also unpacks: iterated from
synchronous code (no event loop running in this thread), it runs the rollout to its end on an
event loop of its own and yields the two results; iterated inside a running event loop, it
raises instead of blocking that loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator, Iterator
from typing import Any

__all__ = ["RolloutCall"]


class RolloutCall(Coroutine[Any, Any, tuple[Any, Any]]):
    """A rollout coroutine (``await`` it, or pass it to ``asyncio.run``) that synchronous
    code may unpack directly: ``final, metrics = call``.

    >>> async def rollout():
    ...     return "final", {"turns": 3}
    >>> final, metrics = RolloutCall(rollout())
    >>> final, metrics
    ('final', {'turns': 3})
    >>> asyncio.run(RolloutCall(rollout()))
    ('final', {'turns': 3})
    """

    def __init__(self, coroutine: Coroutine[Any, Any, tuple[Any, Any]]) -> None:
        self._coroutine = coroutine

    def send(self, value: Any) -> Any:
        return self._coroutine.send(value)

    def throw(self, *args: Any) -> Any:
        return self._coroutine.throw(*args)

    def close(self) -> None:
        self._coroutine.close()

    def __await__(self) -> Generator[Any, None, tuple[Any, Any]]:
        return self._coroutine.__await__()

    def __iter__(self) -> Iterator[Any]:
        """Run the rollout here and now (no event loop may be running in this thread) and
        iterate over ``(final_batch, metrics)``."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return iter(asyncio.run(self._coroutine))
        self._coroutine.close()
        raise RuntimeError(
            "run_async_multi_turn_rollout(...) was unpacked inside a running event loop, "
            "which it cannot block; there, write `final, metrics = await "
            "run_async_multi_turn_rollout(...)`."
        )
