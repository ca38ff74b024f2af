"""One call of an environment, awaited on the event loop: ``step`` or ``step_stream``, on a
Ray actor or in process, as an async iterator of ``(positions, value)`` items.

A batched ``step`` gives one item for every sample of the call; ``step_stream`` (every
:class:`~envloop.environments.sample_environment.SampleEnvironment` has it) gives an item as
each sample finishes. Actor calls are awaited directly (Ray completes the awaited
reference from its own thread; no thread of ours waits); an in-process call runs on a thread
of a :class:`~envloop.distributed.daemon_threads.DaemonThreadPool`, handing its items to the
loop.

Each call has a deadline: past it, an actor's call is cancelled and the actor restarted
(:func:`~envloop.experience.env_actors.retire_stuck_actor`) and :class:`ActorTimeout` raised;
an in-process call is abandoned on its daemon thread and ``TimeoutError`` raised. A call
cancelled by its caller (a rollout that closes) is waited for until it ends or its deadline
passes, so that closing leaves no step running behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from envloop.distributed.daemon_threads import DaemonThreadPool
from envloop.experience.env_actors import retire_stuck_actor

Item = tuple[list[int], Any]
"""Positions of the call's samples that a value answers, and the value (an
``EnvironmentReturn`` or what the environment returned in its place)."""


class ActorTimeout(TimeoutError):
    """An actor's step timed out, and the actor was killed for Ray to restart."""


def remaining_s(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (a ``time.monotonic()`` value; None: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


async def actor_step(
    env: Any, logs: list[list[dict]], metadata: list[Any], deadline: float | None
) -> AsyncIterator[Item]:
    """``env.step`` on a Ray actor: one item for every position."""
    sent_at = time.monotonic()
    ref = env.step.remote(logs, metadata)
    try:
        value = await asyncio.wait_for(_value_of(ref), remaining_s(deadline))
    except TimeoutError:
        retire_stuck_actor(env, ref, sent_at)
        raise ActorTimeout from None
    except asyncio.CancelledError:
        await _settle(_value_of(ref), deadline)
        raise
    yield list(range(len(logs))), value


async def actor_step_stream(
    env: Any, logs: list[list[dict]], metadata: list[Any], deadline: float | None
) -> AsyncIterator[Item]:
    """``env.astep_stream`` on a Ray actor (a streaming generator): each item as it comes."""
    sent_at = time.monotonic()
    stream = env.astep_stream.options(num_returns="streaming").remote(logs, metadata)
    while True:
        try:
            ref = await asyncio.wait_for(anext(stream), remaining_s(deadline))
        except StopAsyncIteration:
            return
        except TimeoutError:
            retire_stuck_actor(env, stream, sent_at)
            raise ActorTimeout from None
        except asyncio.CancelledError:
            await _settle(_drained(stream), deadline)
            raise
        yield await ref


async def thread_step(
    pool: DaemonThreadPool,
    env: Any,
    logs: list[list[dict]],
    metadata: list[Any],
    deadline: float | None,
) -> AsyncIterator[Item]:
    """``env.step`` in process, on a thread of ``pool``, on copies of ``logs`` and
    ``metadata`` (an in-process environment sees what an actor would: its own objects)."""
    future = asyncio.wrap_future(
        pool.submit(env.step, copy.deepcopy(logs), copy.deepcopy(metadata))
    )
    try:
        value = await asyncio.wait_for(asyncio.shield(future), remaining_s(deadline))
    except asyncio.CancelledError:
        await _settle(future, deadline)
        raise
    yield list(range(len(logs))), value


async def thread_step_stream(
    env: Any, logs: list[list[dict]], metadata: list[Any], deadline: float | None
) -> AsyncIterator[Item]:
    """``env.step_stream`` in process, drained by a daemon thread of its own (one stuck on a
    sample past the deadline must not keep the interpreter from exiting); each item as it
    comes."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue[Item | BaseException | None] = asyncio.Queue()
    stream = env.step_stream(copy.deepcopy(logs), copy.deepcopy(metadata))
    ended = threading.Event()
    drain = threading.Thread(
        target=_drain_into, args=(stream, loop, items, ended), name="envloop-env", daemon=True
    )
    drain.start()
    while True:
        try:
            item = await asyncio.wait_for(items.get(), remaining_s(deadline))
        except asyncio.CancelledError:
            await _settle(asyncio.to_thread(ended.wait, remaining_s(deadline)), deadline)
            raise
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


async def _value_of(ref: Any) -> Any:
    return await ref


async def _drained(stream: Any) -> None:
    async for _ in stream:
        pass


async def _settle(work: Any, deadline: float | None) -> None:
    """Wait for ``work`` (a cancelled call's own end) until ``deadline``; whatever it
    returns or raises is dropped."""
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(work, remaining_s(deadline))


def _drain_into(
    stream: Iterator[Item],
    loop: asyncio.AbstractEventLoop,
    items: asyncio.Queue[Item | BaseException | None],
    ended: threading.Event,
) -> None:
    """Put each item of ``stream`` into ``items`` on ``loop``, then None (or the exception it
    raised); an item for a loop that has closed (its call was abandoned) is dropped."""

    def put(item: Item | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed
            loop.call_soon_threadsafe(items.put_nowait, item)

    try:
        for item in stream:
            put(item)
        put(None)
    except BaseException as exc:
        put(exc)
    finally:
        ended.set()
