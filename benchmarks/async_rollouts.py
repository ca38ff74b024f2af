"""The async rollout engine against the sync engine, side by side in one run (issue 12).

``overhead``: the engine's own cost per sample-turn with the zero-cost workload of
``rollout_overhead.py`` (1,024 samples x 4 turns, a policy that costs ~nothing, a Ray-actor
environment); overhead = rollout wall time minus the policy's own ``generate`` time. Target:
async within 1.5x of sync.

``streaming``: the same workload and measure with a zero-cost policy whose ``generate_async``
hands rows back one per event-loop tick (as continuous batching and inference servers do),
for the sync engine (its ``generate``), ``RolloutStream`` (``run_async_multi_turn_rollout``)
and ``ExperienceStream`` (the rows as ``DatumSpec`` dicts, groups of one, every sample in
flight, no staleness bound); each against the sync run beside it. Target: within 1.5x of
sync.

``long-tail``: wall time on a workload whose turn counts (1-12), response lengths and
environment latencies differ per sample and are heavy-tailed (5% of responses and of
environment steps take 50x the median), against a simulated batched decoder (see
:class:`Decoder`) and a simulated parallel sandbox (see :class:`SandboxEnv`). Targets: async
at least 2x faster than sync, and within 1.25x of the lower bound (see
:meth:`LongTailWorkload.lower_bound_s`).

``switch-interval``: the ``streaming`` engines with the interpreter's GIL switch interval
(``sys.setswitchinterval``) at Python's 5 ms and lower, all interleaved in one run, each
engine's overhead against the sync loop's at 5 ms: the environment calls' Ray round trips
wait for the GIL while the event loop's thread does bookkeeping.

``profile``: one engine once under cProfile (the event loop's thread), top functions by own
and cumulative time: ``--engine async`` on the ``overhead`` workload, ``RolloutStream`` or
``ExperienceStream`` on the ``streaming`` one, ``long-tail`` the async engine on the long tail.

    .venv/bin/python benchmarks/async_rollouts.py
        [all|overhead|streaming|switch-interval|long-tail|profile]
        [--engine ENGINE] [--repeats N] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import heapq
import io
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _workloads import (
    PHASES,
    CountdownEnv,
    FixedResponsePolicy,
    StreamingResponsePolicy,
    load_avg,
    make_batch,
    start_ray,
)

import envloop
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.tokenization import decode_texts
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.interfaces import EnvironmentReturn, actor_class
from envloop.environments.sample_environment import SampleEnvironment, SampleStep
from envloop.experience.rollouts import (
    ExperienceStream,
    run_async_multi_turn_rollout,
    run_multi_turn_rollout,
)
from envloop.models.generation.interfaces import GenerationInterface
from tests.fixtures.tiny_models import build_tiny_tokenizer

ENGINES = ("sync", "async")
STREAMING_ENGINES = ("sync", "RolloutStream", "ExperienceStream")


def run_engine(engine: str, *args: Any, **options: Any) -> tuple[BatchedDataDict, dict]:
    """``run_multi_turn_rollout`` (sync) or ``run_async_multi_turn_rollout`` (async).

    The async engine runs inside a coroutine that returns nothing: before the fix of CPython
    gh-112559 (in 3.11.7, say), ``asyncio.run`` formats the ``repr`` of its main task's
    result twice, seconds for a final batch of 1,024 samples (``async, result from
    asyncio.run`` measures it)."""
    if engine == "sync":
        return run_multi_turn_rollout(*args, **options)
    if engine == "ExperienceStream":
        return run_experience_stream(*args, **options)
    rollout = run_async_multi_turn_rollout(*args, **options)
    if engine == "async, result from asyncio.run":
        return asyncio.run(rollout)
    result = []

    async def keep_result() -> None:
        result.append(await rollout)

    asyncio.run(keep_result())
    return result[0]


def run_experience_stream(
    policy: Any, batch: BatchedDataDict, tokenizer: Any, envs: dict, max_seq_len: int
) -> tuple[None, dict]:
    """The batch's rows, as ``DatumSpec`` dicts, through one ``ExperienceStream`` (groups of
    one, every sample in flight at once, no staleness bound); its metrics."""
    rows = [{key: batch[key][i] for key in batch} for i in range(batch.size)]

    async def consume() -> dict:
        stream = ExperienceStream(
            policy, rows, tokenizer, envs, max_seq_len, group_size=1,
            max_concurrent_samples=batch.size, max_staleness=None,
        )  # fmt: skip
        async for _ in stream:
            pass
        return stream.metrics()

    return None, asyncio.run(consume())


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ``values``, to 1 decimal."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


# --- overhead ---------------------------------------------------------------------------------


def overhead_run(
    engine: str,
    args: argparse.Namespace,
    tokenizer: Any,
    env: Any,
    policy_class: type | None = None,
) -> dict:
    """One zero-cost rollout: µs per sample-turn of overhead in total and per phase (with
    ``policy_class``, default :class:`FixedResponsePolicy`)."""
    import ray

    policy = (policy_class or FixedResponsePolicy)(tokenizer)
    batch = make_batch(tokenizer, args.samples)
    env_cpu = ray.get(env.process_seconds.remote())
    cpu, start = time.process_time(), time.perf_counter()
    _, metrics = run_engine(engine, policy, batch, tokenizer, {"countdown": env}, 512)
    overhead = time.perf_counter() - start - policy.seconds
    cpu = time.process_time() - cpu - policy.cpu_seconds
    cpu += ray.get(env.process_seconds.remote()) - env_cpu
    sample_turns = args.samples * args.turns
    if metrics["total_turns"] != sample_turns:  # ExperienceStream counts them too
        raise RuntimeError(f"{engine}: {metrics['total_turns']} turns, expected {sample_turns}")
    us = {p: 1e6 * metrics[f"timing/{p}_s"] / sample_turns for p in PHASES}
    us["CPU"] = 1e6 * cpu / sample_turns
    us["total overhead"] = 1e6 * overhead / sample_turns
    return us


def overhead_runs(
    engines: tuple[str, ...], args: argparse.Namespace, tokenizer: Any, policy_class: type
) -> dict[str, list[dict]]:
    """``args.repeats`` zero-cost rollouts per engine, interleaved (so load drift hits every
    engine alike), against one Ray-actor environment."""
    import ray

    env = actor_class(CountdownEnv, num_cpus=0).remote(args.turns)
    ray.get(env.__ray_ready__.remote())
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repeats):
        for engine in engines:
            runs[engine].append(overhead_run(engine, args, tokenizer, env, policy_class))
    ray.kill(env)
    return runs


def overhead_table(engines: tuple[str, ...], runs: dict[str, list[dict]]) -> list[str]:
    """Per phase, each engine's median (min-max), and each engine's total against sync:
    the median of the per-repetition ratios (each run against the sync run beside it) and
    their spread."""
    others = engines[1:]
    lines = [
        "| phase | " + " | ".join(engines) + " |",
        "|---|" + "---:|" * len(engines),
    ]
    for phase in [*PHASES, "total overhead"]:
        cells = [spread([r[phase] for r in runs[e]]) for e in engines]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| CPU, driver + environment actor | " + " | ".join(
        spread([r["CPU"] for r in runs[e]]) for e in engines) + " |")  # fmt: skip
    for measure, label in (("total overhead", "total"), ("CPU", "CPU")):
        sync = [r[measure] for r in runs["sync"]]
        ratios = [[r[measure] / s for r, s in zip(runs[e], sync)] for e in others]
        cells = [spread_ratio(values) for values in ratios]
        lines.append(f"| {label} / sync, per repetition | 1 | " + " | ".join(cells) + " |")
    return lines


def spread_ratio(values: list[float]) -> str:
    """``median (min-max)x`` of ratios, to 2 decimals."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def overhead_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    import ray

    runs = overhead_runs(ENGINES, args, tokenizer, FixedResponsePolicy)
    env = actor_class(CountdownEnv, num_cpus=0).remote(args.turns)
    ray.get(env.__ray_ready__.remote())
    direct = overhead_run("async, result from asyncio.run", args, tokenizer, env)
    ray.kill(env)
    sync_total = statistics.median(r["total overhead"] for r in runs["sync"])
    return [
        f"Overhead, µs per sample-turn ({args.samples} samples x {args.turns} turns, zero-cost "
        f"policy answering each call in one batch, Ray-actor env; median (min-max) of "
        f"{args.repeats}; load {load_avg()})",
        "",
        *overhead_table(ENGINES, runs),
        "",
        "(A phase counts the wall time during which at least one of its calls ran; async phases "
        "overlap one another.) The async "
        "engine returned straight from `asyncio.run(run_async_multi_turn_rollout(...))`, one "
        f"run: {direct['total overhead']:.1f} µs per sample-turn, "
        f"{direct['total overhead'] / sync_total:.2f}x sync (Python {platform.python_version()}"
        ": asyncio.run formats the repr of its result twice unless fixed, CPython gh-112559).",
    ]


def streaming_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    runs = overhead_runs(STREAMING_ENGINES, args, tokenizer, StreamingResponsePolicy)
    return [
        f"Overhead with a streaming policy, µs per sample-turn ({args.samples} samples x "
        f"{args.turns} turns, zero-cost policy whose generate_async hands rows back one per "
        f"event-loop tick, Ray-actor env; sync calls its generate; RolloutStream is "
        f"run_async_multi_turn_rollout, ExperienceStream takes the rows as DatumSpec dicts "
        f"(group_size=1, max_concurrent_samples={args.samples}, max_staleness=None); median "
        f"(min-max) of {args.repeats}, engines interleaved; load {load_avg()})",
        "",
        *overhead_table(STREAMING_ENGINES, runs),
    ]


SWITCH_INTERVALS_S = (0.005, 0.001, 0.0005)
"""The GIL switch intervals ``switch-interval`` compares (Python's default first)."""


def switch_interval_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    import ray

    env = actor_class(CountdownEnv, num_cpus=0).remote(args.turns)
    ray.get(env.__ray_ready__.remote())
    default = sys.getswitchinterval()
    runs: dict[tuple[float, str], list[dict]] = {}
    try:
        for _ in range(args.repeats):
            for interval in SWITCH_INTERVALS_S:
                sys.setswitchinterval(interval)
                for engine in STREAMING_ENGINES:
                    run = overhead_run(engine, args, tokenizer, env, StreamingResponsePolicy)
                    runs.setdefault((interval, engine), []).append(run)
    finally:
        sys.setswitchinterval(default)
        ray.kill(env)
    base = [r["total overhead"] for r in runs[(SWITCH_INTERVALS_S[0], "sync")]]
    lines = [
        f"Overhead with a streaming policy by GIL switch interval, µs per sample-turn "
        f"({args.samples} samples x {args.turns} turns, the streaming section's workload; "
        f"median (min-max) of {args.repeats}, intervals and engines interleaved; each ratio "
        f"per repetition against the sync loop at 5 ms; load {load_avg()})",
        "",
        "| switch interval | engine | total overhead | / sync at 5 ms |",
        "|---:|---|---:|---:|",
    ]
    for (interval, engine), values in runs.items():
        totals = [r["total overhead"] for r in values]
        ratios = [t / b for t, b in zip(totals, base)]
        lines.append(
            f"| {interval * 1e3:g} ms | {engine} | {spread(totals)} | {spread_ratio(ratios)} |"
        )
    return lines


PROFILED = {
    "async": FixedResponsePolicy,
    "RolloutStream": StreamingResponsePolicy,
    "ExperienceStream": StreamingResponsePolicy,
}
"""The engines ``profile`` can run on the overhead workload, each with its policy."""


def profile_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    """``args.engine`` once on the overhead workload (or the async engine once on the long
    tail), under cProfile."""
    import ray

    if args.engine == "long-tail":
        workload = LongTailWorkload.draw(
            args.lt_samples, args.lt_turns, args.step_ms / 1e3, args.cap
        )
        env = long_tail_env(workload)
        run = lambda: long_tail_run("async", workload, tokenizer, env)  # noqa: E731
        measured = "wall {wall:.2f} s"
    else:
        env = actor_class(CountdownEnv, num_cpus=0).remote(args.turns)
        policy = PROFILED[args.engine]
        run = lambda: overhead_run(args.engine, args, tokenizer, env, policy)  # noqa: E731
        measured = "overhead {total overhead:.1f} µs per sample-turn"
    ray.get(env.__ray_ready__.remote())
    run()  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    result = run()
    profiler.disable()
    ray.kill(env)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(50)
    return [
        f"{args.engine} under cProfile (the event loop's thread; "
        + measured.format(**result)
        + f" with the profiler on; load {load_avg()})",
        "```",
        text.getvalue().strip(),
        "```",
    ]


# --- long tail: workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class LongTailWorkload:
    """What every sample does, fixed per (sample, turn) so both engines do the same work.

    Attributes:
        turns: [N] int, turns of each sample (its environment ends it after that many).
        lengths: [N, T] int, response tokens of each sample's turn t.
        latencies: [N, T] float, seconds of each sample's environment step t.
        step_s: seconds per decode step.
        cap: most requests in one decode step.
    """

    turns: np.ndarray
    lengths: np.ndarray
    latencies: np.ndarray
    step_s: float
    cap: int

    @classmethod
    def draw(cls, samples: int, max_turns: int, step_s: float, cap: int, seed: int = 0):
        """Turns uniform in 1..max_turns; response lengths lognormal around 16 tokens and
        env latencies lognormal around 8 ms, each with 5% of steps at 50x the median."""
        rng = np.random.default_rng(seed)
        shape = (samples, max_turns)

        def heavy_tailed(median: float, sigma: float) -> np.ndarray:
            body = median * rng.lognormal(0.0, sigma, shape)
            return np.where(rng.random(shape) < 0.05, 50 * median, body)

        lengths = np.clip(np.rint(heavy_tailed(16, 0.6)), 1, None).astype(np.int64)
        return cls(
            turns=rng.integers(1, max_turns + 1, samples),
            lengths=lengths,
            latencies=heavy_tailed(0.008, 0.5),
            step_s=step_s,
            cap=cap,
        )

    def own_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, latencies)`` with the turns a sample never takes zeroed, [N, T]."""
        taken = np.arange(self.lengths.shape[1])[None, :] < self.turns[:, None]
        return self.lengths * taken, self.latencies * taken

    def critical_path_s(self) -> float:
        """The longest sample's own time: its turns one after the other, each its decode
        steps and its environment step."""
        lengths, latencies = self.own_steps()
        return float((lengths * self.step_s + latencies).sum(axis=1).max())

    def throughput_bound_s(self) -> float:
        """Every token decoded at full batches of ``cap``."""
        return int(np.ceil(self.own_steps()[0].sum() / self.cap)) * self.step_s

    def lower_bound_s(self) -> float:
        """No engine can finish sooner: a sample's turn t+1 prompt holds turn t's
        observation, so its turns are sequential (critical path), and a decode step
        advances at most ``cap`` requests by one token (throughput bound)."""
        return max(self.critical_path_s(), self.throughput_bound_s())

    def sync_model_s(self) -> float:
        """The sync engine's time under the cost model alone (no overhead): per turn, the
        decoder on every active sample, then one environment call costing its slowest."""
        total = 0.0
        for t in range(int(self.turns.max())):
            active = self.turns > t
            total += decode_steps(self.lengths[active, t], self.cap) * self.step_s
            total += float(self.latencies[active, t].max())
        return total

    def max_seq_len(self, prompt_tokens: int) -> int:
        """Room for the longest sample: prompt, responses and observations of <= 32 tokens."""
        lengths, _ = self.own_steps()
        return int(prompt_tokens + (lengths + 32).sum(axis=1).max())


def decode_steps(lengths: np.ndarray, cap: int) -> int:
    """Decode steps for requests of ``lengths`` tokens submitted together, at most ``cap``
    running at once, a waiting one joining as soon as a slot frees (FIFO)."""
    ends: list[int] = []
    for n in lengths.tolist():
        start = heapq.heappop(ends) if len(ends) == cap else 0
        heapq.heappush(ends, start + n)
    return max(ends, default=0)


# --- long tail: simulated decoder, policy and environment ------------------------------------


class Decoder:
    """A batched decoder's timing: every ``step_s`` one decode step advances each of up to
    ``cap`` running requests by one token, whatever their number; a request finishes after
    its own length and frees its slot; requests submitted meanwhile join at the next step
    (FIFO). Steps run on a clock of their own in a thread (as a GPU runs beside the Python
    process): a late step is caught up, not lost.

    ``steps`` counts decode steps run, ``token_steps`` the requests advanced over them.
    """

    def __init__(self, step_s: float, cap: int) -> None:
        self.step_s, self.cap = step_s, cap
        self.steps = self.token_steps = 0
        self._waiting: deque[list[Any]] = deque()
        self._running: list[list[Any]] = []
        self._wake = threading.Condition()
        self._closed = False
        threading.Thread(target=self._run, name="decoder", daemon=True).start()

    def submit(self, tokens: int, on_done: Callable[[], None]) -> None:
        """Decode ``tokens`` tokens; ``on_done()`` is called (in the decoder's thread) after
        the step that produces the last one."""
        with self._wake:
            self._waiting.append([tokens, on_done])
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _run(self) -> None:
        next_step = 0.0
        while True:
            with self._wake:
                while not (self._waiting or self._running or self._closed):
                    self._wake.wait()
                if self._closed:
                    return
                if not self._running:  # an idle decoder starts a step right away
                    next_step = time.perf_counter() + self.step_s
                while self._waiting and len(self._running) < self.cap:
                    self._running.append(self._waiting.popleft())
            time.sleep(max(0.0, next_step - time.perf_counter()))
            next_step += self.step_s
            for done in self._step():
                done()

    def _step(self) -> list[Callable[[], None]]:
        self.steps += 1
        self.token_steps += len(self._running)
        finished = []
        for request in self._running:
            request[0] -= 1
            if request[0] <= 0:
                finished.append(request[1])
        self._running = [r for r in self._running if r[0] > 0]
        return finished


class SimulatedPolicy(GenerationInterface):
    """Responses of the workload's lengths, timed by a :class:`Decoder`.

    Each prompt ends with the marker ``[s<sample> t<turn>]`` (the environment writes it in
    every observation), which picks the response length. ``generate`` submits every row and
    returns when the last one is done (c x the longest response, for <= ``cap`` rows);
    ``generate_async`` yields each row (a one-row slice of the call's output, built at once
    as ``generate`` builds it) the step it finishes, and rows of concurrent calls share
    decode steps (continuous batching). ``waits`` maps each (sample, turn) to the
    seconds from its call's start until its row was handed back.
    """

    MARKER = re.compile(r"\[s(\d+) t(\d+)\]")

    def __init__(self, workload: LongTailWorkload, tokenizer: Any) -> None:
        self.workload, self.tokenizer = workload, tokenizer
        (self.token_id,) = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.decoder = Decoder(workload.step_s, workload.cap)
        self.calls = self.rows = 0
        self.call_s = 0.0  # summed over calls, each from its start to its last row
        self.waits: dict[tuple[int, int], float] = {}

    def generate(self, data, greedy=False):
        start, (keys, lengths) = time.perf_counter(), self._lengths(data)
        left, done = [len(lengths)], threading.Event()

        def one_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                done.set()

        for n in lengths:
            self.decoder.submit(n, one_done)
        done.wait()
        seconds = time.perf_counter() - start
        self.call_s += seconds
        self.waits.update(dict.fromkeys(keys, seconds))
        return self._output(data["input_ids"], data["input_lengths"], torch.tensor(lengths))

    async def generate_async(self, data, greedy=False):
        start, (keys, lengths) = time.perf_counter(), self._lengths(data)
        loop, finished = asyncio.get_running_loop(), asyncio.Queue()
        for j, n in enumerate(lengths):
            self.decoder.submit(n, lambda j=j: loop.call_soon_threadsafe(finished.put_nowait, j))
        # Every row's output at once (as generate builds it); each row is handed back as a
        # one-row slice of it when the decoder finishes it.
        output = self._output(data["input_ids"], data["input_lengths"], torch.tensor(lengths))
        for left in range(len(lengths), 0, -1):
            j = await finished.get()
            self.waits[keys[j]] = time.perf_counter() - start
            if left == 1:
                self.call_s += self.waits[keys[j]]
            yield j, output.slice(j, j + 1)

    def shutdown(self) -> bool:
        self.decoder.close()
        return True

    def _lengths(self, data) -> tuple[list[tuple[int, int]], list[int]]:
        """Each row's (sample, turn), read from the marker at the end of its prompt, and
        response length."""
        rows, ends = data["input_ids"].tolist(), data["input_lengths"].tolist()
        tails = decode_texts(
            self.tokenizer, [row[max(0, e - 40) : e] for row, e in zip(rows, ends)]
        )
        keys = [(int(s), int(t)) for s, t in (self.MARKER.findall(x)[-1] for x in tails)]
        budgets = data["max_new_tokens"].tolist()
        self.calls, self.rows = self.calls + 1, self.rows + len(keys)
        return keys, [min(int(self.workload.lengths[k]), b) for k, b in zip(keys, budgets)]

    def _output(self, ids: torch.Tensor, lengths: torch.Tensor, gen: torch.Tensor):
        width = ids.shape[1] + int(gen.max())
        out = torch.full((len(gen), width), self.tokenizer.pad_token_id, dtype=torch.long)
        out[:, : ids.shape[1]] = ids
        positions = torch.arange(width)[None, :]
        generated = (positions >= lengths[:, None]) & (positions < (lengths + gen)[:, None])
        out[generated] = self.token_id
        logprobs = torch.where(generated, -0.5, 0.0)
        return BatchedDataDict(
            output_ids=out, logprobs=logprobs, generation_lengths=gen,
            unpadded_sequence_lengths=lengths + gen,
        )  # fmt: skip


class SandboxEnv(SampleEnvironment):
    """A sandbox service: each sample's step takes its own latency from the workload (an
    awaited call, so a batch's samples run at once), and a sample ends after its own turns.

    Runs as a Ray actor. The sync engine calls ``step`` (a batch takes as long as its slowest
    sample); the async engine calls ``astep_stream``, which hands back each sample as it
    finishes, and overlapping calls overlap. ``calls`` lists each call's sample count."""

    def __init__(self, latencies: np.ndarray, turns: np.ndarray) -> None:
        self.latencies, self.turns = latencies, turns
        self.calls: list[int] = []

    async def astep_sample(self, messages, metadata) -> SampleStep:
        sample, turn = metadata["sample"], metadata["turn"]
        await asyncio.sleep(float(self.latencies[sample, turn]))
        return SampleStep(
            {"role": "user", "content": f"Checked step {turn + 1}. [s{sample} t{turn + 1}]"},
            reward=0.25,
            terminated=bool(turn + 1 >= self.turns[sample]),
            metadata={"sample": sample, "turn": turn + 1},
        )

    def step(self, message_log_batch, metadata, *args, **kwargs) -> EnvironmentReturn:
        self.calls.append(len(metadata))
        return super().step(message_log_batch, metadata)

    async def astep_stream(self, message_log_batch, metadata):
        self.calls.append(len(metadata))
        async for item in super().astep_stream(message_log_batch, metadata):
            yield item

    def take_calls(self) -> list[int]:
        """``calls`` since the last ``take_calls``."""
        calls, self.calls = self.calls, []
        return calls


def long_tail_batch(tokenizer: Any, samples: int) -> BatchedDataDict:
    logs = [
        get_formatted_message_log(
            [{"role": "user", "content": f"Fix the failing test. [s{i} t0]"}],
            tokenizer,
            add_generation_prompt=True,
        )
        for i in range(samples)
    ]
    return BatchedDataDict(
        message_log=logs,
        extra_env_info=[{"sample": i, "turn": 0} for i in range(samples)],
        task_name=["sandbox"] * samples,
        stop_strings=[None] * samples,
        loss_multiplier=[1.0] * samples,
        idx=list(range(samples)),
    )


# --- long tail: measurement -------------------------------------------------------------------


def long_tail_run(engine: str, workload: LongTailWorkload, tokenizer: Any, env: Any) -> dict:
    """One rollout: its wall time, and how the decoder and the environment were called."""
    import ray

    samples = len(workload.turns)
    batch = long_tail_batch(tokenizer, samples)
    max_seq_len = workload.max_seq_len(
        max(sum(len(m["token_ids"]) for m in log) for log in batch["message_log"])
    )
    policy = SimulatedPolicy(workload, tokenizer)
    start = time.perf_counter()
    _, metrics = run_engine(engine, policy, batch, tokenizer, {"sandbox": env}, max_seq_len)
    wall = time.perf_counter() - start
    policy.shutdown()
    expected = (int(workload.turns.sum()), int(workload.own_steps()[0].sum()), 1.0)
    keys = ("total_turns", "total_generated_tokens", "natural_termination_rate")
    got = tuple(metrics[k] for k in keys)
    if got != expected:
        raise RuntimeError(f"{engine} ran (turns, tokens, ended) {got}, drawn: {expected}")
    calls = ray.get(env.take_calls.remote())
    return {
        "wall": wall,
        "gen calls": policy.calls,
        "rows per gen call": policy.rows / policy.calls,
        "in gen calls / wall": policy.call_s / wall,
        "decoder busy": policy.decoder.steps * workload.step_s / wall,
        "rows per decode step": policy.decoder.token_steps / max(policy.decoder.steps, 1),
        "env calls": len(calls),
        "samples per env call": sum(calls) / len(calls),
        "slowest sample: s in gen calls": slowest_in_gen_calls(policy.waits),
    }


def slowest_in_gen_calls(gen_waits: dict) -> float:
    """The most seconds one sample spent in generation calls (until its row came back),
    summed over its turns."""
    per_sample: dict[int, float] = {}
    for (sample, _), seconds in gen_waits.items():
        per_sample[sample] = per_sample.get(sample, 0.0) + seconds
    return max(per_sample.values())


def long_tail_env(workload: LongTailWorkload) -> Any:
    """The workload's :class:`SandboxEnv` as a Ray actor serving every sample at once."""
    samples = len(workload.turns)
    return actor_class(SandboxEnv, num_cpus=0, max_concurrency=samples).remote(
        workload.latencies, workload.turns
    )


def long_tail_section(args: argparse.Namespace, tokenizer: Any) -> list[str]:
    import ray

    workload = LongTailWorkload.draw(args.lt_samples, args.lt_turns, args.step_ms / 1e3, args.cap)
    env = long_tail_env(workload)
    ray.get(env.__ray_ready__.remote())
    runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for _ in range(args.repeats):
        for engine in ENGINES:
            runs[engine].append(long_tail_run(engine, workload, tokenizer, env))
    ray.kill(env)
    return long_tail_table(args, workload, runs)


def long_tail_table(args, workload: LongTailWorkload, runs: dict[str, list[dict]]) -> list[str]:
    bound = workload.lower_bound_s()
    wall = {e: statistics.median(r["wall"] for r in runs[e]) for e in ENGINES}
    lengths, latencies = workload.own_steps()
    taken = lengths > 0
    lines = [
        f"Long-tail rollout, wall seconds ({len(workload.turns)} samples, 1-{args.lt_turns} "
        f"turns, {int(workload.turns.sum())} sample-turns; decode step {args.step_ms} ms for "
        f"up to {workload.cap} rows; responses median {np.median(lengths[taken]):.0f} tokens, "
        f"env steps median {1e3 * np.median(latencies[taken]):.0f} ms, 5% of each at 50x; "
        f"median (min-max) of {args.repeats}; load {load_avg()})",
        "",
        "| | sync | async |",
        "|---|---:|---:|",
        f"| wall s | {spread([r['wall'] for r in runs['sync']])} "
        f"| {spread([r['wall'] for r in runs['async']])} |",
        f"| speed-up vs sync | 1.00x | {wall['sync'] / wall['async']:.2f}x |",
        f"| wall / lower bound ({bound:.2f} s) | {wall['sync'] / bound:.2f} "
        f"| {wall['async'] / bound:.2f} |",
    ]
    for key in [k for k in runs["sync"][0] if k != "wall"]:
        sync, asyn = (statistics.median(r[key] for r in runs[e]) for e in ENGINES)
        lines.append(f"| {key} | {sync:.2f} | {asyn:.2f} |")
    return [
        *lines,
        "",
        f"Lower bound = max(critical path {workload.critical_path_s():.2f} s, throughput bound "
        f"{workload.throughput_bound_s():.2f} s); the sync engine under the cost model alone: "
        f"{workload.sync_model_s():.2f} s. In gen calls: seconds inside generation calls, "
        "summed (over 1: calls overlapped); decoder busy: decode steps x step time.",
    ]


# --- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "section",
        nargs="?",
        default="all",
        choices=["all", "overhead", "streaming", "switch-interval", "long-tail", "profile"],
    )
    parser.add_argument(
        "--engine",
        default="RolloutStream",
        choices=[*PROFILED, "long-tail"],
        help="profile: the engine (on the overhead workload, with its policy), or the async "
        "engine on the long tail",
    )
    parser.add_argument("--quick", action="store_true", help="a small sanity run (~20 s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="default 3 (long tail), 1 (profile), 5 (the others); 1 with --quick",
    )
    parser.add_argument("--samples", type=int, default=1024, help="overhead: samples")
    parser.add_argument("--turns", type=int, default=4, help="overhead: turns per sample")
    parser.add_argument("--lt-samples", type=int, default=512, help="long tail: samples")
    parser.add_argument("--lt-turns", type=int, default=12, help="long tail: most turns per sample")
    parser.add_argument("--step-ms", type=float, default=1.0, help="long tail: ms per decode step")
    parser.add_argument("--cap", type=int, default=256, help="long tail: most rows per decode step")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.lt_samples, args.lt_turns = 128, 64, 4
    return args


def envloop_version() -> str:
    """The commit of the envloop checkout measured, marked when its ``envloop/`` differs."""
    root = Path(envloop.__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "envloop"], capture_output=True
        )
    except OSError:
        return f"envloop at {root}"
    if commit.returncode:
        return f"envloop at {root} (not a git checkout)"
    changed = " + uncommitted changes under envloop/" if dirty.stdout.strip() else ""
    return f"envloop {commit.stdout.decode().strip()}{changed}"


def main() -> None:
    args = parse_args()
    command = "benchmarks/async_rollouts.py " + " ".join(sys.argv[1:])
    start_ray()
    tokenizer = build_tiny_tokenizer()
    sections = {
        "overhead": overhead_section,
        "long-tail": long_tail_section,
        "streaming": streaming_section,
        "switch-interval": switch_interval_section,
        "profile": profile_section,
    }
    chosen = ["overhead", "streaming", "long-tail"] if args.section == "all" else [args.section]
    print(
        f"\n`.venv/bin/python {command.strip()}` ({envloop_version()}; load before: {load_avg()})\n"
    )
    for name in chosen:
        default = 1 if args.quick else {"long-tail": 3, "profile": 1}.get(name, 5)
        section_args = argparse.Namespace(**{**vars(args), "repeats": args.repeats or default})
        print("\n".join(sections[name](section_args, tokenizer)) + "\n", flush=True)


if __name__ == "__main__":
    main()
