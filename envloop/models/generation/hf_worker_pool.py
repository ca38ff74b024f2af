"""``HfWorkerPool``: ``HfGeneration``'s engine over several Ray actors, each hosting an
:class:`~hf_engine.HfEngine` with its own copy of the model.

A batch given to ``generate`` is split into contiguous shards, one per worker. Rows given to
``generate_async`` go one by one to the worker with the fewest rows outstanding (sent by this
process and not yet returned), and come back as each finishes: every worker runs its own
continuous batching loop. The actors are asyncio actors whose methods await their rows, so
the calls of many concurrent consumers are served at once and share that loop.

New weights go to every worker in two phases (:meth:`HfWorkerPool.update_weights`): each
worker checks and prepares them, and only when all have them does any apply them.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.generation_batches import (
    check_generation_input,
    generation_columns,
)
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.hf_engine import HfEngine
from envloop.models.generation.hf_weights import (
    WeightSpec,
    WeightsSource,
    source_kind,
    state_dict_of,
    weights_error,
)
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec
from envloop.models.generation.policy_versions import next_policy_version

WORKER_MAX_CONCURRENCY = 1024
"""Calls a worker actor serves at once (each awaits its rows from the decode loop)."""
OUTPUT_PAD_VALUES: dict[str, int | float] = {"logprobs": 0.0}
"""How the workers' outputs are padded when joined (``output_ids`` with the pad id)."""


class HfWorkerPool:
    """Worker actors (``workers``, each hosting an :class:`HfEngine`) and the rows each has
    outstanding; ``pad_id`` pads the joined outputs.

    Attributes:
        model: always None (each worker holds its own copy).
        on_decode_step: accepted and not called: worker actors do not report steps.
    """

    def __init__(self, workers: list[Any], pad_id: int) -> None:
        self.workers = workers
        self.pad_values = OUTPUT_PAD_VALUES | {"output_ids": pad_id}
        self.outstanding = [0] * len(workers)
        self.model: Any = None
        self.on_decode_step: Callable[[int], None] | None = None
        self._spec: WeightSpec | None = None
        self._policy_version = 0
        self._update_lock = threading.Lock()

    @classmethod
    def start(cls, config: HfGenerationConfig, pad_id: int) -> HfWorkerPool:
        """``config.num_workers`` :class:`HfEngine` actors, seeded ``seed + rank``. Returns
        once every actor has loaded its model, so a loading error surfaces here."""
        import ray

        remote: Any = ray.remote  # its stubs lack max_concurrency
        actor_class: Any = remote(
            num_cpus=config.worker_num_cpus,
            num_gpus=config.worker_num_gpus,
            max_concurrency=WORKER_MAX_CONCURRENCY,
        )(HfEngine)
        workers = [
            actor_class.remote(
                config.model_copy(update={"num_workers": 1, "seed": config.seed + rank})
            )
            for rank in range(config.num_workers)
        ]
        pool = cls(workers, pad_id)
        try:
            pool.prepare_for_generation()
        except Exception:
            pool.shutdown()
            raise
        return pool

    @property
    def policy_version(self) -> int:
        """The version every worker serves: 0, then what each :meth:`update_weights` set."""
        return self._policy_version

    def prepare_for_generation(self) -> bool:
        """Put every worker's model in eval mode."""
        import ray

        return all(ray.get([w.prepare_for_generation.remote() for w in self.workers]))

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Contiguous shards to the workers in parallel, concatenated back in input order."""
        import ray

        check_generation_input(data, vocab_size=None)
        data = generation_columns(data)
        shards = data.shard_by_batch_size(len(self.workers), allow_uneven_shards=True)
        jobs = [(w, s) for w, s in zip(self.workers, shards) if s.size] or [(self.workers[0], data)]
        outputs = ray.get([w.generate_awaiting.remote(shard, greedy) for w, shard in jobs])
        return BatchedDataDict.from_batches(outputs, self.pad_values)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Each row to the least-loaded worker; ``(row, output)`` as each finishes."""
        check_generation_input(data, vocab_size=None)
        data = generation_columns(data)
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
                .generate_async.options(num_returns="streaming")
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

    def iter_generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> Iterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Not served by worker actors: raises ``NotImplementedError`` saying what is."""
        raise NotImplementedError(
            "iter_generate runs the decode loop of this process (num_workers: 1); with "
            "workers, iterate over generate_async (async for row, output in ...) instead"
        )

    def update_weights(self, weights: WeightsSource, *, version: int | None = None) -> int:
        """Make every worker serve ``weights`` as ``version`` (None: the next one); returns
        it once all do.

        A state dict or module is checked against the workers' model first (nothing is
        sent if it does not fit), then put in the object store once: every worker gets the
        same reference. A folder goes as its absolute path. Phase one: every worker checks
        and prepares its copy; if any fails, all drop what they prepared and the first
        error is raised, so no worker changes. Phase two: every worker applies its copy
        between two of its decode steps; only a worker whose decode loop itself breaks can
        fail there (its rows fail too), and the others keep the new weights.
        """
        with self._update_lock:
            new = next_policy_version(self._policy_version, version)
            self._update_workers(weights, new)
            self._policy_version = new
        return new

    def _update_workers(self, weights: WeightsSource, version: int) -> None:
        import ray

        payload = self._payload(weights)
        errors = []
        for staging in [w.stage_weights.remote(payload, version) for w in self.workers]:
            try:
                ray.get(staging)
            except Exception as error:  # after every worker is done: none stages late
                errors.append(error)
        if errors:
            ray.get([w.drop_staged_weights.remote() for w in self.workers])
            raise errors[0]
        ray.get([w.commit_weights.remote(version) for w in self.workers])

    def _payload(self, weights: WeightsSource) -> Any:
        """What the workers get: a folder's absolute path, or a reference to the state dict
        (on the CPU) in the object store, once it is checked against the workers' model."""
        import ray

        if isinstance(weights, (str, os.PathLike)):
            return str(Path(weights).resolve())
        state = state_dict_of(weights)
        if self._spec is None:
            self._spec = ray.get(self.workers[0].weight_spec.remote())
        problems = self._spec.problems(state)
        if problems:
            raise weights_error(f"the {source_kind(weights)}", problems)
        return ray.put({key: tensor.detach().cpu() for key, tensor in state.items()})

    def decode_stats(self) -> list[dict[str, int]]:
        """Each worker's decode counters, in worker order."""
        import ray

        per_worker = ray.get([w.decode_stats.remote() for w in self.workers])
        return [stats for worker_stats in per_worker for stats in worker_stats]

    def shutdown(self) -> None:
        """Kill the worker actors."""
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
