"""The worker actors of :class:`~hf_worker_pool.HfWorkerPool`: starting them where
``worker_placement`` says, waiting (bounded) until they serve, telling a lost worker from a
call that failed, and the rows of a worker lost for good.

A worker is an :class:`~hf_engine.HfEngine` in a Ray actor that Ray never restarts
(``max_restarts: 0``): a restarted actor would run its constructor again and serve the
first weights, so the pool starts a replacement itself and gives it the current ones.
"""

from __future__ import annotations

from typing import Any

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import placement_options
from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.generation_batches import build_output
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.hf_engine import HfEngine
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec

WORKER_MAX_CONCURRENCY = 1024
"""Calls a worker actor serves at once (each awaits its rows from the decode loop)."""


class WorkerStartError(RuntimeError):
    """Worker actors that did not serve within ``worker_startup_timeout_s``."""


def start_worker(config: HfGenerationConfig, rank: int) -> Any:
    """Worker ``rank``'s actor (seeded ``seed + rank``), placed as ``config.worker_placement``
    says (:func:`~envloop.distributed.ray_utils.placement_options`); returns its handle at
    once (the model loads in the actor)."""
    import ray

    remote: Any = ray.remote  # its stubs lack max_concurrency
    actor_class: Any = remote(
        num_cpus=config.worker_num_cpus,
        num_gpus=config.worker_num_gpus,
        max_concurrency=WORKER_MAX_CONCURRENCY,
        max_restarts=0,
    )(HfEngine)
    placed = actor_class.options(**placement_options(config.worker_placement))
    return placed.remote(config.model_copy(update={"num_workers": 1, "seed": config.seed + rank}))


def wait_serving(workers: list[Any], config: HfGenerationConfig) -> None:
    """Wait until every actor of ``workers`` has loaded its model and put it in eval mode,
    at most ``config.worker_startup_timeout_s``; a loading error is raised as it is, and
    actors not ready by then are killed and named in a :class:`WorkerStartError`."""
    import ray

    refs = [w.prepare_for_generation.remote() for w in workers]
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=config.worker_startup_timeout_s)
    ray.get(ready)
    if late:
        for worker, ref in zip(workers, refs):
            if ref in late:
                ray.kill(worker)
        raise WorkerStartError(
            f"{len(late)} of {len(workers)} HfGeneration worker actors did not start within "
            f"worker_startup_timeout_s={config.worker_startup_timeout_s:g}: no alive node "
            f"could place an actor reserving worker_num_cpus={config.worker_num_cpus:g} and "
            f"worker_num_gpus={config.worker_num_gpus:g} with worker_placement="
            f"{config.worker_placement!r}, or its model loaded slower than that. Add nodes "
            "with those resources, lower worker_num_cpus / worker_num_gpus, or raise "
            "worker_startup_timeout_s."
        )


def worker_lost(error: BaseException) -> bool:
    """Whether ``error`` says a worker actor is gone (its process or node died) or the
    results it made were lost with its node, rather than that a call failed in it."""
    from ray.exceptions import ObjectLostError, RayActorError

    return isinstance(error, (RayActorError, ObjectLostError, WorkerStartError))


def node_of(_engine: HfEngine) -> str:
    """The Ray node id (hex) of the process this runs in (run in a worker actor with
    ``__ray_call__``)."""
    import ray

    return str(ray.get_runtime_context().get_node_id())


def lost_rows_output(
    data: BatchedDataDict[GenerationDatumSpec], rows: list[int], pad_id: int, error: str
) -> BatchedDataDict[GenerationOutputSpec]:
    """Outputs for ``rows`` of ``data`` that no worker generated: the prompt, no tokens, and
    ``error`` in ``generation_error`` (the rollout ends those samples as failed)."""
    ids, lengths = data["input_ids"][rows], data["input_lengths"][rows]
    output = build_output(ids, lengths, [SampleResult() for _ in rows], pad_id)
    output["generation_error"] = [error] * len(rows)
    return output
