"""LoopThread: one event loop on a daemon thread, reached from other threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from envloop.distributed.loop_thread import LoopThread


def test_coroutines_run_on_the_loops_own_thread_and_share_its_state():
    runner = LoopThread("test-loop")
    try:

        async def where() -> tuple[str, asyncio.AbstractEventLoop]:
            return threading.current_thread().name, asyncio.get_running_loop()

        assert runner.run(where()) == ("test-loop", runner.loop)
        assert runner.thread.daemon
        event = runner.run(_make_event())  # made on the loop in one call, awaited in the next
        waiting = runner.submit(event.wait())
        runner.loop.call_soon_threadsafe(event.set)
        assert waiting.result(timeout=10) is True
    finally:
        runner.close(wait=True)


async def _make_event() -> asyncio.Event:
    return asyncio.Event()


def test_a_submit_from_the_loops_thread_raises_the_given_text():
    runner = LoopThread("test-loop", "await it instead")
    try:

        async def nested() -> None:
            runner.submit(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="^await it instead$"):
            runner.run(nested())
    finally:
        runner.close(wait=True)


def test_close_stops_the_thread_and_closes_the_loop_and_may_be_repeated():
    runner = LoopThread("test-loop")
    assert runner.running
    runner.close(wait=True)
    assert not runner.running and runner.loop.is_closed()
    runner.close(wait=True)


def test_close_without_waiting_returns_while_a_callback_still_runs():
    runner = LoopThread("test-loop")
    started, release = threading.Event(), threading.Event()
    runner.loop.call_soon_threadsafe(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    runner.close()
    assert runner.running  # the loop stops once the running callback returns
    release.set()
    runner.thread.join(10)
    assert not runner.running and runner.loop.is_closed()
