"""``envloop run``: a config in, a run directory out.

The steps: load and tokenize the prompts, checked against ``rollout.max_seq_len``
(:mod:`envloop.run.preflight`) -> start (or join) Ray -> start one environment actor per
task -> load the policy meanwhile -> wait for the actors (each start-up phase timed into
``metrics.json``'s ``startup``) -> roll out ``rollout.batch_size`` samples at a time
(progress while generating, after each turn and, in ``rollout.mode: async``, after each
finished sample), appending to the rollout files in sample order -> each environment's
``global_post_process_and_metrics`` -> ``metrics.json``. Both modes write the same files,
rows and metrics.
The command line then prints the summary table and builds ``report.html``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.async_rollouts import RolloutStream
from envloop.experience.phase_timer import PhaseTimer
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.server_generation import ServerGeneration
from envloop.run.config import RunConfig
from envloop.run.config_sections import (
    PolicyConfig,
    RayConfig,
    RolloutConfig,
    ServerPolicyConfig,
)
from envloop.run.envs import env_metrics, start_envs, stop_envs, wait_until_ready
from envloop.run.metrics import (
    TaskStats,
    combine_rollout_metrics,
    per_task_metrics,
    startup_metrics,
)
from envloop.run.outputs import RunWriter
from envloop.run.preflight import RunInputs, prepare_inputs
from envloop.run.progress import Progress
from envloop.run.records import PARQUET_ONLY_KEYS, sample_records
from envloop.run.termination import reclaim_sigterm

Policy = HfGeneration | ServerGeneration
"""The backends a run config can name (``policy.backend``)."""


@dataclass
class RunResult:
    """What a finished run produced."""

    run_dir: Path
    stats: dict[str, TaskStats]  # per task: samples, mean reward, mean turns
    metrics: dict[str, Any]  # what metrics.json holds


def run(
    config: RunConfig,
    *,
    quiet: bool = False,
    stream: IO[str] | None = None,
    inputs: RunInputs | None = None,
) -> RunResult:
    """Run ``config`` (see the module docstring); progress goes to ``stream`` (stdout).
    ``inputs``: the prompts already checked and tokenized by
    :func:`~envloop.run.preflight.prepare_inputs` (else done here, before Ray starts)."""
    out = stream if stream is not None else sys.stdout
    started = time.perf_counter()
    inputs = inputs if inputs is not None else prepare_inputs(config)
    tasks = ", ".join(config.envs)
    prompts = f"{len(inputs.samples)} prompt{'s' * (len(inputs.samples) != 1)}"
    out.write(f"{prompts} from {config.data.path}, tasks: {tasks}\n")
    startup = PhaseTimer()  # its phases go to metrics.json's "startup"
    startup.seconds["prompt_tokenization"] = inputs.seconds
    with startup.phase("ray"):
        ray_started = start_ray(config.ray)
    policy: Policy | None = None
    envs: dict[str, Any] = {}
    try:
        with startup.phase("envs_launch"):
            envs = start_envs(config.envs)  # they start while the policy loads
        with startup.phase("policy_load"):
            policy = make_policy(config.policy)
        _check_takes_images(config, policy)
        batch = inputs.rollout_batch(config)  # tokenized before Ray started
        with startup.phase("envs_wait"):
            wait_until_ready(envs, config.envs, config.rollout.env_startup_timeout_s)
        progress = Progress(batch.size, out, quiet, per_sample=config.rollout.mode == "async")
        if isinstance(policy, HfGeneration):  # a live token count while it generates
            policy.on_decode_step = progress.on_tokens
        return _roll_out(config, policy, batch, envs, progress, started, startup)
    finally:
        stop_envs(envs)
        if policy is not None:
            policy.shutdown()
        if ray_started:
            import ray

            ray.shutdown()


def make_policy(policy: PolicyConfig) -> Policy:
    """The policy of the ``policy`` section (the backend's own config)."""
    if isinstance(policy, ServerPolicyConfig):
        return ServerGeneration(policy)
    return HfGeneration(policy)


def engine_tokenizer(policy: Policy) -> Any:
    """What the rollout engine tokenizes with: the policy's multimodal processor when it has
    one (so observations may hold images), else its tokenizer."""
    processor = getattr(policy, "processor", None)
    return processor if processor is not None else policy.tokenizer


def _check_takes_images(config: RunConfig, policy: Policy) -> None:
    """An image dataset's policy must have a processor (the preflight checks this before
    the model loads; this catches a policy that loaded without one)."""
    column = config.data.columns.images
    if column is not None and getattr(policy, "processor", None) is None:
        raise ConfigError(
            "run config",
            [f"data.columns.images: column {column!r} holds images, but the policy "
             f"(policy.backend: {config.policy.backend}) loaded without an image processor; "
             "name a vision-language model, or set data.columns.images: null"],
        )  # fmt: skip


def start_ray(ray_config: RayConfig) -> bool:
    """Join or start Ray; True when this call started a local session (to shut down
    later). A local session's workers get the current directory on their PYTHONPATH, so
    environments given as ``module:Class`` import there as they do here."""
    import ray

    from envloop.distributed.ray_utils import init_ray

    if ray.is_initialized():
        reclaim_sigterm()
        return False
    if not (ray_config.address or os.environ.get("RAY_ADDRESS")):
        paths = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    init_ray(ray_config.address, ray_config.num_cpus, log_to_driver=ray_config.log_to_driver)
    reclaim_sigterm()  # ray.init installed its own SIGTERM handler
    return True


def _roll_out(
    config: RunConfig,
    policy: Policy,
    batch: BatchedDataDict[Any],
    envs: dict[str, Any],
    progress: Progress,
    started: float,
    startup: PhaseTimer,
) -> RunResult:
    rollout, parts, kept = config.rollout, [], []
    with RunWriter(config.output.dir) as writer:
        writer.write_config(config.to_dict())
        progress.start()
        for start in range(0, batch.size, rollout.batch_size):
            part = batch.slice(start, start + rollout.batch_size)
            records, metrics = _roll_out_batch(rollout, policy, part, envs, progress, start)
            writer.add(records)
            progress.update(
                records, metrics["total_generated_tokens"], metrics["timing/generation_s"]
            )
            parts.append((metrics, part.size))
            kept += [{k: v for k, v in r.items() if k not in PARQUET_ONLY_KEYS} for r in records]
        progress.close()
        metrics = {
            "rollout": combine_rollout_metrics(parts),
            "envs": env_metrics(envs, kept),
            "per_task": per_task_metrics(progress.stats),
            "startup": startup_metrics(startup),
            "wall_time_s": time.perf_counter() - started,
        }
        writer.write_metrics(metrics)
    return RunResult(Path(config.output.dir), progress.stats, metrics)


def _roll_out_batch(
    rollout: RolloutConfig,
    policy: Policy,
    part: BatchedDataDict[Any],
    envs: dict[str, Any],
    progress: Progress,
    first_sample: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The sample records (in input order, numbered from ``first_sample``) and rollout
    metrics of one batch, rolled out in ``rollout.mode``; an async rollout reports each
    sample to ``progress`` as it finishes."""
    args = (policy, part, engine_tokenizer(policy), envs, rollout.max_seq_len, rollout.max_turns)
    options = {"greedy": rollout.greedy, "on_turn": progress.on_turn, **rollout.engine_options()}
    if rollout.mode == "async":
        stream = RolloutStream(*args, **options)
        records = asyncio.run(_streamed_records(stream, first_sample, progress.on_sample))
        return records, stream.metrics()
    final, metrics = run_multi_turn_rollout(*args, **options)
    return sample_records(final, first_sample), metrics


async def _streamed_records(
    stream: RolloutStream, first_sample: int, on_record: Callable[[Mapping[str, Any]], None]
) -> list[dict[str, Any]]:
    """The records of ``stream``'s samples in input order, each passed to ``on_record`` as
    its sample finishes."""
    records = []
    async for sample in stream:
        [record] = sample_records(sample.batch, first_sample + sample.index)
        on_record(record)
        records.append(record)
    return sorted(records, key=lambda record: record["sample"])
