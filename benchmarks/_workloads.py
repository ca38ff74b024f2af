"""The zero-cost rollout workload shared by the overhead benchmarks: a Ray-actor countdown
environment, a policy that appends a fixed response for (almost) nothing (in one batch, or
handing rows back one at a time as continuous batching does), and its batch.

Scripts import this module by name; they put ``benchmarks/`` on ``PYTHONPATH`` so that Ray
workers can import it too (see :func:`start_ray`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.models.generation.interfaces import GenerationInterface

PHASES = ["flatten", "gen_bookkeeping", "env_step", "rewards_and_status", "obs_tokenization"]
RESPONSE = "<step>thinking it over</step>"


def start_ray() -> None:
    """A local Ray instance on the machine's 2 cores, whose workers can import this module."""
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parent)
    from envloop.distributed.ray_utils import init_ray

    init_ray(num_cpus=2, log_to_driver=False)


def load_avg() -> str:
    """The 1-, 5- and 15-minute load averages, as ``/proc/loadavg`` gives them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class CountdownEnv(EnvironmentInterface):
    """Answers every turn; ends the episode after ``turns`` turns (kept in metadata)."""

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns

    def process_seconds(self) -> float:
        """CPU time of the process this environment runs in (its Ray actor's, as an actor)."""
        return time.process_time()

    def step(self, message_log_batch, metadata, *args, **kwargs) -> EnvironmentReturn:
        done_turns = [md["turn"] + 1 for md in metadata]
        return EnvironmentReturn(
            [
                {"role": "user", "content": f"Environment: turn {t} of {self.turns}. Continue."}
                for t in done_turns
            ],
            [{"turn": t} for t in done_turns],
            [["</step>"]] * len(done_turns),
            torch.full((len(done_turns),), 0.25),
            torch.tensor([t >= self.turns for t in done_turns]),
        )

    def global_post_process_and_metrics(self, batch):
        return batch, {}


class FixedResponsePolicy(GenerationInterface):
    """Appends the same response tokens to every prompt (vectorized: costs ~nothing);
    ``seconds`` adds up the time spent in ``generate``, ``cpu_seconds`` its CPU time."""

    def __init__(self, tokenizer: Any, text: str = RESPONSE) -> None:
        self.response = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        self.pad_id = tokenizer.pad_token_id
        self.seconds = self.cpu_seconds = 0.0

    def generate(self, data, greedy=False):
        start, cpu_start = time.perf_counter(), time.thread_time()
        ids, lengths = data["input_ids"], data["input_lengths"]
        n, b = len(self.response), len(lengths)
        out = torch.full((b, ids.shape[1] + n), self.pad_id, dtype=torch.long)
        out[:, : ids.shape[1]] = ids
        cols = lengths[:, None] + torch.arange(n)
        out.scatter_(1, cols, self.response.expand(b, n))
        logprobs = torch.zeros(out.shape, dtype=torch.float32)
        logprobs.scatter_(1, cols, -0.5)
        gen = torch.full((b,), n, dtype=torch.long)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu_start
        return BatchedDataDict(
            output_ids=out, logprobs=logprobs, generation_lengths=gen,
            unpadded_sequence_lengths=lengths + gen,
        )  # fmt: skip


def make_batch(tokenizer: Any, samples: int) -> BatchedDataDict:
    """``samples`` copies of one countdown prompt, task ``countdown``, turn 0."""
    prompt = get_formatted_message_log(
        [{"role": "user", "content": "Count down with me, one step at a time."}],
        tokenizer,
        add_generation_prompt=True,
    )
    return BatchedDataDict(
        message_log=[[dict(m) for m in prompt] for _ in range(samples)],
        extra_env_info=[{"turn": 0} for _ in range(samples)],
        task_name=["countdown"] * samples,
        stop_strings=[["</step>"]] * samples,
        loss_multiplier=[1.0] * samples,
        idx=list(range(samples)),
    )


class StreamingResponsePolicy(FixedResponsePolicy):
    """:class:`FixedResponsePolicy` whose ``generate_async`` hands rows back one at a time,
    as ``HfGeneration``'s continuous batching and ``ServerGeneration`` do: ``(row, one-row
    output)``, each after a turn of the event loop (``await asyncio.sleep(0)``), so no two
    rows arrive in the same tick. Outputs carry ``policy_versions`` (0, as a backend at its
    first weights reports them). ``seconds`` counts only the policy's own work."""

    def generate(self, data, greedy=False):
        output = super().generate(data, greedy)
        start, cpu_start = time.perf_counter(), time.thread_time()
        output["policy_versions"] = torch.zeros(output["output_ids"].shape, dtype=torch.int32)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu_start
        return output

    async def generate_async(self, data, greedy=False):
        output = self.generate(data, greedy)
        for j in range(len(output["generation_lengths"])):
            await asyncio.sleep(0)
            start, cpu_start = time.perf_counter(), time.thread_time()
            row = output.slice(j, j + 1)
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu_start
            yield j, row


class GcTimer:
    """CPU time this process spends in the cyclic garbage collector inside the block."""

    def __init__(self) -> None:
        self.seconds, self._start = 0.0, 0.0

    def __enter__(self) -> GcTimer:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.seconds += time.process_time() - self._start
