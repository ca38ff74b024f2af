"""``HfGeneration`` on several Ray actors, each with its own copy of the model.

A batch given to ``generate`` is split into contiguous shards, one per worker. Rows given to
``generate_async`` go one by one to the worker with the fewest rows outstanding (sent by this
process and not yet returned), and come back as each finishes: every worker runs its own
continuous batching loop. The actors are asyncio actors whose methods await their rows, so
the calls of many concurrent consumers are served at once and share that loop.

New weights go to every worker in two phases (:meth:`WorkerPool.update_weights`): each
worker checks and prepares them, and only when all have them does any apply them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_weights import (
    WeightSpec,
    WeightsSource,
    source_kind,
    state_dict_of,
    weights_error,
)
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec

WORKER_MAX_CONCURRENCY = 1024
"""Calls a worker actor serves at once (each awaits its rows from the decode loop)."""


class WorkerPool:
    """Worker actors and the rows each has outstanding."""

    def __init__(self, workers: list[Any], pad_values: dict[str, int | float]) -> None:
        self.workers, self.pad_values = workers, pad_values
        self.outstanding = [0] * len(workers)
        self._spec: WeightSpec | None = None

    @classmethod
    def start(cls, actor: type, config: Any, pad_values: dict[str, int | float]) -> WorkerPool:
        """``config.num_workers`` actors of class ``actor`` (an in-process generation
        backend), seeded ``seed + rank``. Returns once every actor has loaded its model, so a
        loading error surfaces here."""
        import ray

        remote: Any = ray.remote  # its stubs lack max_concurrency
        actor_class: Any = remote(
            num_cpus=config.worker_num_cpus,
            num_gpus=config.worker_num_gpus,
            max_concurrency=WORKER_MAX_CONCURRENCY,
        )(actor)
        workers = [
            actor_class.remote(
                config.model_copy(update={"num_workers": 1, "seed": config.seed + rank})
            )
            for rank in range(config.num_workers)
        ]
        pool = cls(workers, pad_values)
        try:
            pool.prepare()
        except Exception:
            pool.shutdown()
            raise
        return pool

    def prepare(self) -> bool:
        import ray

        return all(ray.get([w.prepare_for_generation.remote() for w in self.workers]))

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Contiguous shards to the workers in parallel, concatenated back in input order."""
        import ray

        shards = data.shard_by_batch_size(len(self.workers), allow_uneven_shards=True)
        jobs = [(w, s) for w, s in zip(self.workers, shards) if s.size] or [(self.workers[0], data)]
        outputs = ray.get([w._generate_awaiting.remote(shard, greedy) for w, shard in jobs])
        return BatchedDataDict.from_batches(outputs, self.pad_values)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Each row to the least-loaded worker; ``(row, output)`` as each finishes."""
        routes: dict[int, list[int]] = {}
        for row in range(data.size):
            rank = min(range(len(self.workers)), key=self.outstanding.__getitem__)
            self.outstanding[rank] += 1
            routes.setdefault(rank, []).append(row)
        finished: asyncio.Queue[tuple[int, Any] | BaseException] = asyncio.Queue()
        readers = [
            asyncio.ensure_future(self._read(rank, rows, data, greedy, finished))
            for rank, rows in routes.items()
        ]
        try:
            for _ in range(data.size):
                item = await finished.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for reader in readers:
                reader.cancel()

    async def _read(
        self,
        rank: int,
        rows: list[int],
        data: BatchedDataDict[GenerationDatumSpec],
        greedy: bool,
        finished: asyncio.Queue[tuple[int, Any] | BaseException],
    ) -> None:
        """Stream worker ``rank``'s rows into ``finished``, as ``(input row, output)``."""
        import ray

        left = len(rows)
        try:
            stream = (
                self.workers[rank]
                ._stream_rows.options(num_returns="streaming")
                .remote(data.select_indices(rows), greedy)
            )
            async for ref in stream:
                shard_row, output = await ref
                left -= 1
                self.outstanding[rank] -= 1
                finished.put_nowait((rows[shard_row], output))
        except asyncio.CancelledError:
            ray.cancel(stream)
            raise
        except BaseException as error:
            finished.put_nowait(error)
        finally:
            self.outstanding[rank] -= left

    def update_weights(self, weights: WeightsSource, version: int) -> None:
        """Make every worker serve ``weights`` as ``version``; returns once all do.

        A state dict or module is checked against the workers' model first (nothing is
        sent if it does not fit), then put in the object store once: every worker gets the
        same reference. A folder goes as its absolute path. Phase one: every worker checks
        and prepares its copy; if any fails, all drop what they prepared and the first
        error is raised, so no worker changes. Phase two: every worker applies its copy
        between two of its decode steps; only a worker whose decode loop itself breaks can
        fail there (its rows fail too), and the others keep the new weights.
        """
        import ray

        payload = self._payload(weights)
        errors = []
        for staging in [w._stage_weights.remote(payload, version) for w in self.workers]:
            try:
                ray.get(staging)
            except Exception as error:  # after every worker is done: none stages late
                errors.append(error)
        if errors:
            ray.get([w._drop_staged_weights.remote() for w in self.workers])
            raise errors[0]
        ray.get([w._commit_weights.remote(version) for w in self.workers])

    def _payload(self, weights: WeightsSource) -> Any:
        """What the workers get: a folder's absolute path, or a reference to the state dict
        (on the CPU) in the object store, once it is checked against the workers' model."""
        import ray

        if isinstance(weights, (str, os.PathLike)):
            return str(Path(weights).resolve())
        state = state_dict_of(weights)
        if self._spec is None:
            self._spec = ray.get(self.workers[0]._weight_spec.remote())
        problems = self._spec.problems(state)
        if problems:
            raise weights_error(f"the {source_kind(weights)}", problems)
        return ray.put({key: tensor.detach().cpu() for key, tensor in state.items()})

    def stats(self) -> list[dict[str, int]]:
        """Each worker's decode counters."""
        import ray

        per_worker = ray.get([w.decode_stats.remote() for w in self.workers])
        return [stats for worker_stats in per_worker for stats in worker_stats]

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
