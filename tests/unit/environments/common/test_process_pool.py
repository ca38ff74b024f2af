"""HardTimeoutPool: order, exceptions, hard timeouts and crashes, each fails only its item."""

from __future__ import annotations

import time

import pytest

from envloop.environments.common.process_pool import HardTimeoutPool, Outcome
from tests.fixtures.pool_tasks import (
    square_or_misbehave,
    warm_up_marker,
    warm_up_seen,
    worker_pid,
)

# Items that must finish get a generous limit (they take microseconds, but a loaded machine
# can stall a process for seconds); the hang test uses its own short one.
TIMEOUT_S = 30.0
SHORT_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pool():
    pool = HardTimeoutPool(square_or_misbehave, num_workers=2, timeout_s=TIMEOUT_S)
    yield pool
    pool.close()


def test_results_come_back_in_item_order(pool):
    outcomes = pool.map([("ok", i) for i in range(20)])
    assert [o.value for o in outcomes] == [i * i for i in range(20)]
    assert all(o.error is None for o in outcomes)


def test_exception_is_reported_for_its_item_only(pool):
    outcomes = pool.map([("ok", 3), ("raise", "bad input"), ("ok", 4)])
    assert outcomes == [Outcome(9), Outcome(error="ValueError: bad input"), Outcome(16)]


def test_hang_is_killed_after_the_timeout_and_the_worker_replaced():
    pool = HardTimeoutPool(square_or_misbehave, num_workers=2, timeout_s=SHORT_TIMEOUT_S)
    try:
        outcomes = pool.map([("sleep", 3600), ("ok", 5), ("ok", 6), ("ok", 7)])
        assert outcomes[0] == Outcome(error="timed out after 2.0 s")
        assert [o.value for o in outcomes[1:]] == [25, 36, 49]
        assert pool.replaced == 1
        assert [o.value for o in pool.map([("ok", 2), ("ok", 3)])] == [4, 9]
    finally:
        pool.close()


def test_an_answer_found_after_the_deadline_is_kept_not_timed_out(pool):
    # a loaded machine: the worker answered, but this process looked only after the deadline
    before = pool.replaced
    pool._send(0, ("ok", 12))
    assert pool._workers[0].conn.poll(TIMEOUT_S)
    outcomes: list[Outcome | None] = [None]
    pool._collect({0: (0, time.monotonic() - 1.0)}, outcomes)
    assert outcomes == [Outcome(144)]
    assert pool.replaced == before


def test_warm_up_runs_in_each_worker_before_its_items():
    pool = HardTimeoutPool(warm_up_seen, num_workers=2, timeout_s=TIMEOUT_S, warm_up=warm_up_marker)
    try:
        assert [o.value for o in pool.map(list(range(6)))] == [True] * 6
    finally:
        pool.close()


def test_crash_is_reported_and_the_worker_replaced(pool):
    before = pool.replaced
    outcomes = pool.map([("ok", 1), ("crash", None), ("ok", 2)])
    assert outcomes[1] == Outcome(error="worker process died (exit code 3)")
    assert [outcomes[0].value, outcomes[2].value] == [1, 4]
    assert pool.replaced == before + 1


def test_work_spreads_over_the_workers():
    pool = HardTimeoutPool(worker_pid, num_workers=2, timeout_s=TIMEOUT_S)
    try:
        pids = {o.value for o in pool.map(list(range(40)))}
        assert len(pids) == 2
    finally:
        pool.close()


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="num_workers >= 1 and timeout_s > 0, got 0 and 1"):
        HardTimeoutPool(worker_pid, num_workers=0, timeout_s=1)
