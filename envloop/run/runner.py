"""``envloop run``: a config in, a run directory out.

The steps: load and tokenize the prompts, checked against ``rollout.max_seq_len``
(:mod:`envloop.run.preflight`) -> start (or join) Ray -> start one environment actor per
task -> load the policy meanwhile -> wait for the actors (each start-up phase timed into
``metrics.json``'s ``startup``) -> roll out ``rollout.batch_size`` samples at a time
(progress while generating, after each turn and, in ``rollout.mode: async``, after each
finished sample), each finished sample recorded in the run's journal
(:mod:`envloop.run.journal`: appended and fsynced as it finishes in async mode, with its
batch in sync mode) -> the rollout files, in sample order, from the journal -> each
environment's ``global_post_process_and_metrics`` -> ``metrics.json``. Both modes write the
same files, rows and metrics.

With ``resume``, the journal already in the run directory is kept (once
:mod:`envloop.run.resume` accepts the config and prompts) and only the samples it lacks
are rolled out, in the batches the first run made of them. A signal stops the run as
:mod:`envloop.run.termination` says. See docs/resume.md.
The command line then prints the summary table and builds ``report.html``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
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
from envloop.run.head_watch import HeadWatch
from envloop.run.journal import JournalWriter, RunJournal, read_header
from envloop.run.metrics import (
    TaskStats,
    combine_rollout_metrics,
    per_task_metrics,
    startup_metrics,
    tally,
)
from envloop.run.outputs import write_config, write_metrics, write_rollouts
from envloop.run.preflight import RunInputs, prepare_inputs
from envloop.run.progress import Progress
from envloop.run.records import jsonable, sample_records
from envloop.run.resume import check_resumable, input_fingerprint
from envloop.run.termination import (
    RunStopped,
    admitting_work,
    reclaim_sigterm,
    resume_command,
    stop_requested,
    stopping_calls,
)

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
    resume: bool = False,
) -> RunResult:
    """Run ``config`` (see the module docstring); progress goes to ``stream`` (stdout).
    ``inputs``: the prompts already checked and tokenized by
    :func:`~envloop.run.preflight.prepare_inputs` (else done here, before Ray starts).
    ``resume``: keep the finished samples of the run in ``output.dir`` and roll out only
    the others (:func:`open_journal`; a ConfigError, before Ray starts, when the config
    changed in a way that changes results). Raises :class:`RunStopped` after writing
    what finished when a signal stopped the run (:mod:`envloop.run.termination`)."""
    out = stream if stream is not None else sys.stdout
    started = time.perf_counter()
    inputs = inputs if inputs is not None else prepare_inputs(config)
    journal = open_journal(config, inputs, resume)
    try:
        tasks = ", ".join(config.envs)
        prompts = f"{len(inputs.samples)} prompt{'s' * (len(inputs.samples) != 1)}"
        out.write(f"{prompts} from {config.data.path}, tasks: {tasks}\n")
        if resume:
            out.write(
                f"resuming {config.output.dir}: {journal.finished} of {journal.total} samples "
                f"finished earlier (kept), {journal.total - journal.finished} to roll out\n"
            )
        return _start_and_roll_out(config, inputs, journal, out, quiet, started)
    finally:
        journal.close()


def open_journal(config: RunConfig, inputs: RunInputs, resume: bool) -> RunJournal:
    """The journal of ``config.output.dir`` (:mod:`envloop.run.journal`): a new one, or with
    ``resume`` the one there, once :func:`~envloop.run.resume.check_resumable` accepts the
    config and prompts; ``config.yaml`` is written either way."""
    run_dir = config.output.dir
    resolved = jsonable(config.to_dict())
    fingerprint = input_fingerprint(inputs.samples, inputs.token_ids)
    if resume:
        recorded = read_header(run_dir)
        check_resumable(run_dir, recorded["config"], resolved, recorded["inputs"], fingerprint)
        journal = RunJournal.resume(run_dir, resolved)
    else:
        total = len(inputs.samples) * config.rollout.generations_per_prompt
        journal = RunJournal.start(run_dir, resolved, fingerprint, total)
    write_config(run_dir, config.to_dict())
    return journal


def _start_and_roll_out(
    config: RunConfig,
    inputs: RunInputs,
    journal: RunJournal,
    out: IO[str],
    quiet: bool,
    started: float,
) -> RunResult:
    startup = PhaseTimer()  # its phases go to metrics.json's "startup"
    startup.seconds["prompt_tokenization"] = inputs.seconds
    with startup.phase("ray"):
        ray_started = start_ray(config.ray)
    policy: Policy | None = None
    envs: dict[str, Any] = {}
    try:
        with HeadWatch(gcs_address(), journal, resume_command):  # a lost head ends the run
            try:
                with startup.phase("envs_launch"):
                    envs = start_envs(config.envs)  # they start while the policy loads
                with startup.phase("policy_load"):
                    policy = make_policy(config.policy)
                _check_takes_images(config, policy)
                batch = inputs.rollout_batch(config)  # tokenized before Ray started
                with startup.phase("envs_wait"):
                    wait_until_ready(envs, config.envs, config.rollout.env_startup_timeout_s)
                per_sample = config.rollout.mode == "async"
                progress = Progress(batch.size, out, quiet, per_sample=per_sample)
                if isinstance(policy, HfGeneration):  # a live token count while it generates
                    policy.on_decode_step = progress.on_tokens
                return _roll_out(config, policy, batch, envs, progress, journal, started, startup)
            finally:
                stop_envs(envs)
                if policy is not None:
                    policy.shutdown()
    finally:
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


def gcs_address() -> str | None:
    """``host:port`` of the GCS of the Ray session this process is connected to (on the
    head node); None when Ray does not say (a Ray Client connection, ``ray://``)."""
    import ray

    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:
        return None
    return address if isinstance(address, str) and ":" in address else None


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
    journal: RunJournal,
    started: float,
    startup: PhaseTimer,
) -> RunResult:
    """Roll out every sample the journal has not recorded, ``rollout.batch_size`` samples
    of the input at a time (of a batch partly recorded, the rest), each recorded as it
    finishes (async) or with its batch (sync); then the rollout files and metrics from the
    journal. A signal (:func:`~envloop.run.termination.stop_requested`) stops admitting
    batches (and an async batch's samples): the rollout files are written from what
    finished and :class:`RunStopped` raised."""
    rollout, run_dir = config.rollout, Path(config.output.dir)
    if batch.size != journal.total:
        raise RuntimeError(
            f"{run_dir}: the journal holds a run of {journal.total} samples, the prompts "
            f"make {batch.size}; run without --resume to start over"
        )
    kept = journal.finished
    if kept:
        progress.update(journal.records(images=False))  # the samples finished earlier
    progress.start()
    with admitting_work():
        for start in range(0, batch.size, rollout.batch_size):
            end = min(start + rollout.batch_size, batch.size)
            ids = [i for i in range(start, end) if not journal.is_finished(i)]
            if not ids or stop_requested() is not None:
                continue
            part = batch.slice(start, end) if len(ids) == end - start else batch.select_indices(ids)
            records, metrics = _roll_out_batch(rollout, policy, part, envs, progress, ids, journal)
            if metrics is None:  # an async batch a signal cut short
                progress.update(records)
                continue
            journal.add_batch(metrics, len(ids))
            progress.update(
                records, metrics["total_generated_tokens"], metrics["timing/generation_s"]
            )
        progress.close()
        lines = write_rollouts(run_dir, journal.records())
        signum = stop_requested()
        if signum is not None and journal.finished < journal.total:
            raise RunStopped(signum, journal.finished, journal.total, str(run_dir))
        stats: dict[str, TaskStats] = {}
        tally(lines, stats)
        metrics = {
            "rollout": combine_rollout_metrics(journal.batches),
            "envs": env_metrics(envs, lines),
            "per_task": per_task_metrics(stats),
            "startup": startup_metrics(startup),
            "wall_time_s": time.perf_counter() - started,
            "resume": {"attempt": journal.header.get("attempt", 1), "samples_kept": kept},
        }
        write_metrics(run_dir, metrics)
        journal.remove()  # the run directory holds every sample now
    return RunResult(run_dir, stats, metrics)


def _roll_out_batch(
    rollout: RolloutConfig,
    policy: Policy,
    part: BatchedDataDict[Any],
    envs: dict[str, Any],
    progress: Progress,
    ids: list[int],
    journal: RunJournal,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The sample records (in input order; sample ``ids``, one per row of ``part``) and
    rollout metrics of one batch, rolled out in ``rollout.mode`` and recorded in
    ``journal``: an async rollout hands each sample to the journal's writer thread
    (:class:`~envloop.run.journal.JournalWriter`) and reports it to ``progress`` as it
    finishes, a sync one records the batch when it ends. A signal stops an async batch's
    stream from admitting samples (``RolloutStream.stop_admitting``): the records are then
    those of the samples that finished, and the metrics None."""
    args = (policy, part, engine_tokenizer(policy), envs, rollout.max_seq_len, rollout.max_turns)
    options = {"greedy": rollout.greedy, "on_turn": progress.on_turn, **rollout.engine_options()}
    if rollout.mode == "async":
        stream = RolloutStream(*args, **options)
        writer = JournalWriter(journal)  # the event loop never waits for the disk

        def finished(record: dict[str, Any]) -> None:
            writer.put(record)
            progress.on_sample(record)

        try:
            with stopping_calls(stream.stop_admitting):
                records = asyncio.run(_streamed_records(stream, ids, finished))
        finally:
            writer.flush()
        return records, stream.metrics() if len(records) == len(ids) else None
    final, metrics = run_multi_turn_rollout(*args, **options)
    records = sample_records(final, ids=ids)
    journal.add(*records)
    return records, metrics


async def _streamed_records(
    stream: RolloutStream, ids: list[int], on_record: Callable[[dict[str, Any]], None]
) -> list[dict[str, Any]]:
    """The records of ``stream``'s samples (sample ``ids[i]`` for its row ``i``) in input
    order, each passed to ``on_record`` as its sample finishes."""
    records = []
    async for sample in stream:
        [record] = sample_records(sample.batch, ids=[ids[sample.index]])
        on_record(record)
        records.append(record)
    return sorted(records, key=lambda record: record["sample"])
