"""HfWorkerPool on the local Ray session: a worker actor whose process is killed (by pid) in
the middle of a generation is replaced with the current weights, and its rows are generated
again; with greedy decoding they equal an undisturbed run's. (Losing a whole node of a real
cluster: tests/integration/test_multi_node_generation.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.generation import PROMPTS, make_batch

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HOLD_S = 120.0
"""Longest a held worker waits to be killed."""


def hold_after_first_step(started: str):
    """Run in a worker actor: after the first decode step of its next generation it writes
    its pid to ``started`` and waits (at most :data:`HOLD_S`), its rows mid-generation."""

    def install(worker) -> None:
        def on_step(tokens: int) -> None:
            if not os.path.exists(started):
                Path(started).write_text(str(os.getpid()))
                time.sleep(HOLD_S)

        worker.on_decode_step = on_step

    return install


def kill_when_started(started: Path) -> threading.Thread:
    """A thread that SIGKILLs the process whose pid appears in ``started``."""

    def run() -> None:
        deadline = time.monotonic() + HOLD_S
        while not started.exists() or not started.read_text():
            assert time.monotonic() < deadline, f"{started} did not appear"
            time.sleep(0.05)
        os.kill(int(started.read_text()), signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def noisy_weights(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """The state dict of ``folder``'s model with every tensor moved by noise."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model.state_dict()


def generated(output, row: int) -> tuple[list[int], list[int]]:
    """Row ``row``'s generated token ids and their policy versions."""
    start = int(output["unpadded_sequence_lengths"][row] - output["generation_lengths"][row])
    end = int(output["unpadded_sequence_lengths"][row])
    return output["output_ids"][row, start:end].tolist(), output["policy_versions"][
        row, start:end
    ].tolist()


async def streamed(gen: HfGeneration, batch) -> dict[int, object]:
    return {row: out async for row, out in gen.generate_async(batch, greedy=True)}


def served_versions(ray, gen: HfGeneration) -> list[int]:
    return ray.get([w.__ray_call__.remote(lambda e: e.policy_version) for w in gen.engine.workers])


def test_a_killed_worker_is_replaced_with_the_current_weights_and_its_rows_regenerated(
    ray_session, untied_policy_dir, tmp_path
):
    ray = ray_session
    gen = HfGeneration(
        {"model_name": str(untied_policy_dir), "num_workers": 2, "max_new_tokens": 12,
         "micro_batch_size": 4, "cpu_threads": 1, "worker_num_cpus": 0.5}
    )  # fmt: skip
    try:
        batch = make_batch(gen.tokenizer, PROMPTS[:4])
        assert gen.update_weights(noisy_weights(untied_policy_dir, seed=2)) == 1
        expected = gen.generate(batch, greedy=True)
        rows = [generated(expected, row) for row in range(4)]
        assert all(len(ids) > 2 for ids, _ in rows)  # none ends before the kill
        assert [versions for _, versions in rows] == [[1] * len(ids) for ids, _ in rows]
        node = ray.get_runtime_context().get_node_id()
        assert gen.worker_nodes() == [node, node]

        # generate: worker 1 (rows 2 and 3) dies after its first decode step.
        lost = gen.engine.workers[1]
        ray.get(lost.__ray_call__.remote(hold_after_first_step(str(tmp_path / "sync"))))
        killer = kill_when_started(tmp_path / "sync")
        output = gen.generate(batch, greedy=True)
        killer.join()
        assert gen.engine.workers[1] is not lost
        assert [generated(output, row) for row in range(4)] == rows
        torch.testing.assert_close(output["logprobs"], expected["logprobs"], atol=1e-5, rtol=0)
        assert gen.generation_retries == 2
        assert served_versions(ray, gen) == [1, 1]

        # generate_async: worker 0 (rows 0 and 2, least-loaded routing) dies likewise.
        lost = gen.engine.workers[0]
        ray.get(lost.__ray_call__.remote(hold_after_first_step(str(tmp_path / "async"))))
        killer = kill_when_started(tmp_path / "async")
        outputs = asyncio.run(streamed(gen, batch))
        killer.join()
        assert gen.engine.workers[0] is not lost
        assert {row: generated(out, 0) for row, out in outputs.items()} == dict(enumerate(rows))
        assert gen.generation_retries == 4

        # update_weights with a worker dead: its replacement starts with the new weights.
        pid = ray.get(gen.engine.workers[1].__ray_call__.remote(lambda _: os.getpid()))
        os.kill(pid, signal.SIGKILL)
        assert gen.update_weights(noisy_weights(untied_policy_dir, seed=3)) == 2
        assert served_versions(ray, gen) == [2, 2]
        again = gen.generate(batch, greedy=True)
        assert all(set(generated(again, row)[1]) == {2} for row in range(4))

        # A worker that died idle (between rollouts) is replaced by the next call on it.
        lost = gen.engine.workers[0]
        os.kill(ray.get(lost.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)
        assert gen.prepare_for_generation() and gen.engine.workers[0] is not lost
        assert served_versions(ray, gen) == [2, 2] and len(gen.decode_stats()) == 2

        # A row whose worker is lost more often than worker_max_retries allows fails alone.
        gen.engine.config = gen.engine.config.model_copy(update={"worker_max_retries": 0})
        lost = gen.engine.workers[1]
        ray.get(lost.__ray_call__.remote(hold_after_first_step(str(tmp_path / "fail"))))
        killer = kill_when_started(tmp_path / "fail")
        failed = gen.generate(batch, greedy=True)
        killer.join()
        assert failed["generation_error"][:2] == [None, None]
        assert all("HfGeneration worker 1 was lost" in e for e in failed["generation_error"][2:])
        assert failed["generation_lengths"].tolist()[2:] == [0, 0]
        assert [generated(failed, row) for row in range(2)] == [
            generated(again, row) for row in range(2)
        ]
        assert gen.generation_retries == 4
    finally:
        gen.shutdown()
