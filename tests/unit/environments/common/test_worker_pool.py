"""WorkerPool shards a batch over Ray actor workers and gathers it in order."""

from __future__ import annotations

import pytest

from envloop.environments.common.worker_pool import WorkerPool
from tests.fixtures.pool_tasks import Tagger


def test_in_process_without_ray():
    pool = WorkerPool(Tagger, 4, "p-", use_ray=False)
    assert [t for t, _ in pool.map("tag", ["a", "b", "c"], ["1", "2", "3"])] == [
        "p-a1", "p-b2", "p-c3",
    ]  # fmt: skip
    assert len(pool.workers) == 1


@pytest.mark.ray
def test_ray_workers_keep_order_and_share_the_work(ray_session):
    pool = WorkerPool(Tagger, 3, "r-", ray_options={"num_cpus": 0})
    try:
        out = pool.map("tag", [str(i) for i in range(7)], ["!"] * 7)
        assert [t for t, _ in out] == [f"r-{i}!" for i in range(7)]
        assert len({pid for _, pid in out}) == 3
        assert pool.map("tag", ["x"], ["y"])[0][0] == "r-xy"  # fewer items than workers
        assert pool.map("tag", [], []) == []
    finally:
        pool.shutdown()


def test_bad_worker_count():
    with pytest.raises(ValueError, match="num_workers >= 1, got 0"):
        WorkerPool(Tagger, 0, "x")
