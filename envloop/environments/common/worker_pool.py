"""Split a batch across N worker objects (Ray actors when Ray runs) and gather it in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class WorkerPool:
    """``num_workers`` instances of ``worker_cls(*args)``; :meth:`map` shards a batch over them.

    With Ray initialized the workers are Ray actors (``ray_options`` go to ``.options``);
    without Ray there is one in-process worker, so environments run unchanged in a plain
    Python process (debugging, tests). ``use_ray`` forces either choice.

    >>> class Doubler:
    ...     def run(self, xs, ys):
    ...         return [x * y for x, y in zip(xs, ys)]
    >>> WorkerPool(Doubler, num_workers=3).map("run", [1, 2, 3, 4], [2, 2, 2, 2])
    [2, 4, 6, 8]
    """

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *args: Any,
        ray_options: dict[str, Any] | None = None,
        use_ray: bool | None = None,
    ) -> None:
        import ray

        if num_workers < 1:
            raise ValueError(f"WorkerPool needs num_workers >= 1, got {num_workers}.")
        self.remote = ray.is_initialized() if use_ray is None else use_ray
        if self.remote:
            actor_cls: Any = ray.remote(worker_cls).options(**(ray_options or {}))
            self.workers: list[Any] = [actor_cls.remote(*args) for _ in range(num_workers)]
        else:
            self.workers = [worker_cls(*args)]

    def map(self, method: str, *columns: Sequence[Any]) -> list[Any]:
        """Call ``method`` on contiguous shards of the columns; the per-shard result lists
        are concatenated in input order."""
        n = len(columns[0]) if columns else 0
        shards = _shard_bounds(n, len(self.workers))
        calls = [
            (worker, [list(col[a:b]) for col in columns])
            for worker, (a, b) in zip(self.workers, shards)
            if b > a
        ]
        if self.remote:
            import ray

            parts = ray.get([getattr(w, method).remote(*cols) for w, cols in calls])
        else:
            parts = [getattr(w, method)(*cols) for w, cols in calls]
        return [item for part in parts for item in part]

    def shutdown(self) -> None:
        """Kill the worker actors; in-process workers get their ``close()`` called, if any."""
        for worker in self.workers:
            if self.remote:
                import ray

                ray.kill(worker)
            elif callable(getattr(worker, "close", None)):
                worker.close()
        self.workers = []


def _shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
