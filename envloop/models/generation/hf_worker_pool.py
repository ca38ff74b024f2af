"""``HfWorkerPool``: ``HfGeneration``'s engine over several Ray actors, each hosting an
:class:`~hf_engine.HfEngine` with its own copy of the model.

A batch given to ``generate`` is split into contiguous shards, one per worker. Rows given to
``generate_async`` go one by one to the worker with the fewest rows outstanding (sent by this
process and not yet returned), and come back as each finishes: every worker runs its own
continuous batching loop. The actors are asyncio actors whose methods await their rows, so
the calls of many concurrent consumers are served at once and share that loop.

New weights go to every worker in two phases (:meth:`HfWorkerPool.update_weights`): each
worker checks and prepares them, and only when all have them does any apply them.

A worker lost with its node (or its process) is replaced: a new actor of the same rank and
seed, placed by ``worker_placement`` on the nodes alive, loads the model and the weights of
the last update with their version, and the rows the lost one had not returned are
generated again there from their prompts (at most ``worker_max_retries`` times each, then
they come back with ``generation_error``), counted in :attr:`HfWorkerPool.generation_retries`.
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
from envloop.models.generation.hf_weights import (
    WeightSpec,
    WeightsSource,
    source_kind,
    state_dict_of,
    weights_error,
)
from envloop.models.generation.hf_worker_actors import (
    lost_rows_output,
    node_of,
    start_worker,
    wait_serving,
    worker_lost,
)
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec
from envloop.models.generation.policy_versions import next_policy_version

OUTPUT_PAD_VALUES: dict[str, int | float] = {"logprobs": 0.0}
"""How the workers' outputs are padded when joined (``output_ids`` with the pad id)."""


class HfWorkerPool:
    """Worker actors (``workers``, each hosting an :class:`HfEngine`, started from
    ``config``) and the rows each has outstanding; ``pad_id`` pads the joined outputs.

    Attributes:
        model: always None (each worker holds its own copy).
        on_decode_step: accepted and not called: worker actors do not report steps.
        generation_retries: rows sent again to a worker that replaced a lost one, since
            the pool started (a row sent again twice counts twice).
    """

    def __init__(self, config: HfGenerationConfig, workers: list[Any], pad_id: int) -> None:
        self.config = config
        self.workers = workers
        self.pad_id = pad_id
        self.pad_values = OUTPUT_PAD_VALUES | {"output_ids": pad_id}
        self.outstanding = [0] * len(workers)
        self.model: Any = None
        self.on_decode_step: Callable[[int], None] | None = None
        self.generation_retries = 0
        self._spec: WeightSpec | None = None
        self._policy_version = 0
        self._latest: tuple[Any, int] | None = None
        """The last update's payload and version: what a replacement worker loads."""
        self._update_lock = threading.Lock()
        """Held by an update and by a replacement: one never misses the other."""

    @classmethod
    def start(cls, config: HfGenerationConfig, pad_id: int) -> HfWorkerPool:
        """``config.num_workers`` :class:`HfEngine` actors, seeded ``seed + rank`` and placed
        as ``config.worker_placement`` says. Returns once every actor has loaded its model,
        so a loading error surfaces here (or a :class:`WorkerStartError` after
        ``worker_startup_timeout_s``)."""
        pool = cls(
            config, [start_worker(config, rank) for rank in range(config.num_workers)], pad_id
        )
        try:
            wait_serving(pool.workers, config)
        except Exception:
            pool.shutdown()
            raise
        return pool

    @property
    def policy_version(self) -> int:
        """The version every worker serves: 0, then what each :meth:`update_weights` set."""
        return self._policy_version

    def prepare_for_generation(self) -> bool:
        """Put every worker's model in eval mode (replacing a lost worker)."""
        return all(self._call_all("prepare_for_generation"))

    def worker_nodes(self) -> list[str]:
        """The Ray node id (hex) each worker runs on, in worker order (a lost worker's
        replacement's)."""
        return [str(node) for node in self._call_all("__ray_call__", node_of)]

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` of every worker, in worker order; a lost worker is replaced
        and its replacement answers."""
        import ray

        workers = list(self.workers)
        refs = [getattr(w, method).remote(*args) for w in workers]
        results = []
        for rank, (worker, ref) in enumerate(zip(workers, refs)):
            try:
                results.append(ray.get(ref))
            except Exception as error:
                if not worker_lost(error):
                    raise
                replacement = self._replace(rank, worker)
                results.append(ray.get(getattr(replacement, method).remote(*args)))
        return results

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Contiguous shards to the workers in parallel, concatenated back in input order;
        a shard whose worker was lost is generated again by its replacement."""
        import ray

        check_generation_input(data, vocab_size=None)
        data = generation_columns(data)
        bounds, start = [], 0
        for shard in data.shard_by_batch_size(len(self.workers), allow_uneven_shards=True):
            bounds.append(list(range(start, start + shard.size)))
            start += shard.size
        jobs = {rank: rows for rank, rows in enumerate(bounds) if rows} or {0: []}
        outputs: dict[int, BatchedDataDict[GenerationOutputSpec]] = {}
        attempts = dict.fromkeys(jobs, 0)
        sent = dict(self._send_shard(rank, jobs[rank], data, greedy) for rank in jobs)
        while sent:
            [ref], _ = ray.wait(list(sent), num_returns=1)
            rank, worker = sent.pop(ref)
            try:
                outputs[rank] = ray.get(ref)
                continue
            except Exception as error:
                if not worker_lost(error):
                    for other in sent:
                        ray.cancel(other)
                    raise
                failure = error
            while attempts[rank] < self.config.worker_max_retries:
                attempts[rank] += 1
                try:
                    worker = self._replace(rank, worker)
                except Exception as error:
                    if not worker_lost(error):
                        raise
                    failure = error
                    continue
                self.generation_retries += len(jobs[rank])
                ref, to = self._send_shard(rank, jobs[rank], data, greedy)
                sent[ref] = to
                break
            else:
                outputs[rank] = lost_rows_output(
                    data, jobs[rank], self.pad_id, _lost_message(rank, attempts[rank], failure)
                )
        joined = [outputs[rank] for rank in sorted(outputs)]
        if any("generation_error" in output for output in joined):
            for output in joined:
                output.setdefault("generation_error", [None] * output.size)
        return BatchedDataDict.from_batches(joined, self.pad_values)

    def _send_shard(
        self, rank: int, rows: list[int], data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[Any, tuple[int, Any]]:
        """Worker ``rank``'s call generating ``rows`` of ``data`` (all of it for no rows):
        its reference, and the rank and handle it went to."""
        shard = data.select_indices(rows) if rows else data
        worker = self.workers[rank]
        return worker.generate_awaiting.remote(shard, greedy), (rank, worker)

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
        """Stream worker ``rank``'s rows into ``finished``, as ``(input row, output)``; the
        rows not returned when the worker is lost go to its replacement."""
        left = list(rows)
        worker = self.workers[rank]
        failure: BaseException | None = None
        try:
            for attempt in range(self.config.worker_max_retries + 1):
                try:
                    if attempt:
                        worker = await asyncio.to_thread(self._replace, rank, worker)
                        self.generation_retries += len(left)
                    await self._stream(rank, worker, left, data, greedy, finished)
                    return
                except Exception as error:
                    if not worker_lost(error):
                        finished.put_nowait(error)
                        return
                    failure = error
            assert failure is not None
            message = _lost_message(rank, self.config.worker_max_retries, failure)
            output = lost_rows_output(data, left, self.pad_id, message)
            for k, row in enumerate(list(left)):
                left.remove(row)
                self.outstanding[rank] -= 1
                finished.put_nowait((row, output.slice(k, k + 1)))
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            finished.put_nowait(error)
        finally:
            self.outstanding[rank] -= len(left)

    async def _stream(
        self,
        rank: int,
        worker: Any,
        left: list[int],
        data: BatchedDataDict[GenerationDatumSpec],
        greedy: bool,
        finished: asyncio.Queue[tuple[int, Any] | BaseException],
    ) -> None:
        """One call of ``worker`` generating the rows ``left`` (removed as each comes)."""
        import ray

        sent = list(left)
        stream = (
            worker.generate_async.options(num_returns="streaming")
            .remote(data.select_indices(sent), greedy)
        )  # fmt: skip
        try:
            async for ref in stream:
                shard_row, output = await ref
                left.remove(sent[shard_row])
                self.outstanding[rank] -= 1
                finished.put_nowait((sent[shard_row], output))
        except asyncio.CancelledError:
            ray.cancel(stream)
            raise

    def _replace(self, rank: int, lost: Any) -> Any:
        """The worker at ``rank`` once ``lost`` (its handle seen failing) is replaced: a new
        actor serving the last update's weights and version; another caller's replacement
        if it came first."""
        with self._update_lock:
            return self._replace_locked(rank, lost)

    def _replace_locked(self, rank: int, lost: Any) -> Any:
        import ray

        if self.workers[rank] is not lost:
            return self.workers[rank]
        ray.kill(lost)  # gone already, or unreachable: never two workers of one rank
        worker = start_worker(self.config, rank)
        try:
            wait_serving([worker], self.config)
            if self._latest is not None:
                payload, version = self._latest
                ray.get(worker.stage_weights.remote(payload, version))
                ray.get(worker.commit_weights.remote(version))
        except BaseException:
            ray.kill(worker)
            raise
        self.workers[rank] = worker
        return worker

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

        The pool keeps this update (the reference, so one copy of a state dict stays in the
        object store until the next update, or the path) for the workers that replace lost
        ones; a worker lost during the update is replaced before it returns, with it.
        """
        with self._update_lock:
            new = next_policy_version(self._policy_version, version)
            self._update_workers(weights, new)
            self._policy_version = new
        return new

    def _update_workers(self, weights: WeightsSource, version: int) -> None:
        import ray

        payload = self._payload(weights)
        lost: dict[int, Any] = {}
        errors = []
        staging = [w.stage_weights.remote(payload, version) for w in self.workers]
        for rank, (worker, ref) in enumerate(zip(self.workers, staging)):
            try:
                ray.get(ref)
            except Exception as error:  # after every worker is done: none stages late
                if worker_lost(error):
                    lost[rank] = worker
                else:
                    errors.append(error)
        if errors:
            live = [w for rank, w in enumerate(self.workers) if rank not in lost]
            ray.get([w.drop_staged_weights.remote() for w in live])
            raise errors[0]
        commits = {
            rank: w.commit_weights.remote(version)
            for rank, w in enumerate(self.workers)
            if rank not in lost
        }
        for rank, ref in commits.items():
            try:
                ray.get(ref)
            except Exception as error:
                if not worker_lost(error):
                    raise
                lost[rank] = self.workers[rank]
        self._latest = (payload, version)
        for rank, worker in lost.items():
            self._replace_locked(rank, worker)

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
        """Each worker's decode counters, in worker order (a lost worker's replacement's
        start at 0)."""
        per_worker = self._call_all("decode_stats")
        return [stats for worker_stats in per_worker for stats in worker_stats]

    def shutdown(self) -> None:
        """Kill the worker actors."""
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def _lost_message(rank: int, retries: int, error: BaseException) -> str:
    """The ``generation_error`` of rows whose worker was lost once more than allowed."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"HfGeneration worker {rank} was lost and its rows were generated again {retries} "
        f"time(s) (worker_max_retries={retries}), and the last worker was lost too: "
        f"{type(error).__name__}: {first}"
    )
