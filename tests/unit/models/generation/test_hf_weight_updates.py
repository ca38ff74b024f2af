"""HfGeneration.update_weights on the tiny policy: each token's logprob is that of the
weights whose version it carries, an update lands between two decode steps of rows in
flight, and a bad input changes nothing.

References (temperature 1, no top-k or top-p, so a token's logprob is log_softmax(logits)
at it):
- teacher forcing: one forward pass of a model over the whole sequence;
- ``keep``: the rows' KV cache stays as the old weights computed it. The reference runs the
  old model over the prompt and the tokens generated before the update (its cache), and the
  new model over the rest on top of that cache. The token drawn right after the update
  still comes from the old weights' logits.
- ``recompute``: the cache and logits are rebuilt from the new weights over the sequence so
  far, so every token from the update on is teacher-forced by the new weights.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.decode_loop import cache_keyword
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.tiny import build_tiny_model
from tests.fixtures.generation import PROMPTS, make_batch

BUDGET = 10
SPLIT = 4  # the update lands after this many decode steps
SEED = 3  # with it, no row of PROMPTS[:3] stops before BUDGET under either weights


@pytest.fixture(scope="module")
def old_model(untied_policy_dir: Path):
    return AutoModelForCausalLM.from_pretrained(untied_policy_dir).eval()


@pytest.fixture(scope="module")
def new_model(untied_policy_dir: Path):
    """The untied policy's architecture with other weights (every tensor moved by noise)."""
    model = AutoModelForCausalLM.from_pretrained(untied_policy_dir).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return model


def policy(folder: Path, **options) -> HfGeneration:
    return HfGeneration(
        {"model_name": str(folder), "max_new_tokens": BUDGET, "seed": SEED, **options}
    )


@torch.no_grad()
def forced(model, ids: list[int], start: int) -> torch.Tensor:
    """Teacher-forced logprobs [len(ids) - start] of ids[start:] in one pass over ``ids``."""
    logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@torch.no_grad()
def continued(old, new, ids: list[int], cached: int) -> torch.Tensor:
    """Logprobs [len(ids) - cached - 1] of ids[cached + 1:] from ``new`` running on top of
    ``old``'s KV cache of ids[:cached]."""
    cache = DynamicCache(config=old.config)
    key = cache_keyword(type(old))  # as the decode loop passes it
    old(torch.tensor([ids[:cached]]), **{key: cache}, use_cache=True)
    logits = new(torch.tensor([ids[cached:-1]]), **{key: cache}, use_cache=True).logits
    logprobs = torch.log_softmax(logits[0].float(), dim=-1)
    return logprobs.gather(-1, torch.tensor(ids[cached + 1 :])[:, None])[:, 0]


def rows(out: BatchedDataDict, batch: BatchedDataDict):
    """Per row: its token ids, prompt length, generated count, logprobs and versions of
    the generated tokens; checks prompt and pad positions hold version 0."""
    for row in range(out.size):
        n, end = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        versions = out["policy_versions"][row]
        assert versions.dtype == torch.int32
        assert not versions[:n].any() and not versions[end:].any()
        ids = out["output_ids"][row, :end].tolist()
        yield ids, n, end - n, out["logprobs"][row, n:end], versions[n:end].tolist()


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def far(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two references differ enough for the checks above to tell them apart."""
    return bool((first - second).abs().max() > 1e-2)


def test_tokens_after_an_update_are_the_new_weights_and_before_it_the_old(
    untied_policy_dir, old_model, new_model
):
    gen = policy(untied_policy_dir)
    batch = make_batch(gen.tokenizer, PROMPTS[:3])
    assert gen.policy_version == 0
    before = gen.generate(batch)

    assert gen.update_weights(new_model.state_dict()) == 1
    after = gen.generate(batch)

    assert gen.policy_version == 1
    for out, model, version in ((before, old_model, 0), (after, new_model, 1)):
        for ids, n, k, logprobs, versions in rows(out, batch):
            assert k > 0 and versions == [version] * k
            close(logprobs, forced(model, ids, n))
            other = new_model if model is old_model else old_model
            assert far(forced(other, ids, n), logprobs)
    assert gen.decode_stats()[0]["weight_updates"] == 1


def update_at_step(gen: HfGeneration, weights, late_batch, caller: str):
    """Make ``weights`` land after decode step SPLIT of ``gen``'s loop, and queue
    ``late_batch`` right after it. ``decode_thread``: the step hook calls update_weights
    itself; ``other_thread``: the hook waits there until the test's thread has queued the
    update. Returns a function that starts the update (for other_thread) and the list that
    gets the late rows' iterator."""
    steps: list[int] = []
    late: list = []
    reached = threading.Event()

    def on_step(tokens: int) -> None:
        steps.append(tokens)
        if len(steps) != SPLIT:
            return
        if caller == "decode_thread":
            assert gen.update_weights(weights) == 1
        else:
            reached.set()
            assert gen.engine.batcher.wait_for_update(timeout=60)
        late.append(gen.iter_generate(late_batch))

    def update_from_this_thread() -> None:
        assert reached.wait(timeout=60)
        assert gen.update_weights(weights) == 1

    gen.on_decode_step = on_step
    return update_from_this_thread, late


@pytest.mark.parametrize("caller", ["decode_thread", "other_thread"])
@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_row_in_flight_switches_weights_where_the_update_lands(
    mode, caller, untied_policy_dir, old_model, new_model
):
    gen = policy(untied_policy_dir, kv_cache_on_update=mode)
    batch = make_batch(gen.tokenizer, PROMPTS[:3])
    late_batch = make_batch(gen.tokenizer, PROMPTS[3:4], max_new_tokens=torch.tensor([6]))
    update, late = update_at_step(gen, new_model.state_dict(), late_batch, caller)
    if caller == "decode_thread":
        out = gen.generate(batch)
    else:
        finished = gen.iter_generate(batch)
        update()
        out = BatchedDataDict.from_batches(
            [output for _, output in sorted(finished)], {"output_ids": gen.pad_id}
        )
    late_out = dict(late[0])[0]

    old_tokens = SPLIT + 1 if mode == "keep" else SPLIT  # keep: one more from the old logits
    for ids, n, k, logprobs, versions in rows(out, batch):
        assert k == BUDGET
        assert versions == [0] * old_tokens + [1] * (BUDGET - old_tokens)
        close(logprobs[:old_tokens], forced(old_model, ids, n)[:old_tokens])
        teacher_forced_new = forced(new_model, ids, n)[old_tokens:]
        if mode == "recompute":
            close(logprobs[old_tokens:], teacher_forced_new)
        else:  # the new weights on the old weights' cache of the prompt and SPLIT tokens
            on_old_cache = continued(old_model, new_model, ids, n + SPLIT)
            close(logprobs[old_tokens:], on_old_cache)
            assert far(on_old_cache, teacher_forced_new)
    [(ids, n, k, logprobs, versions)] = rows(late_out, late_batch)
    assert k > 0 and versions == [1] * k  # admitted after the update: prefilled with it
    close(logprobs, forced(new_model, ids, n))
    stats = gen.decode_stats()[0]
    assert stats["weight_updates"] == 1
    assert stats["recomputed_rows"] == (3 if mode == "recompute" else 0)


def test_an_update_from_the_step_hook_lands_after_one_another_thread_queued(
    untied_policy_dir, old_model, new_model
):
    """Thread A's update waits for the loop; the loop's own hook then updates too: both
    land between the same two steps, in call order, and neither waits for the other."""
    gen = policy(untied_policy_dir)
    batch = make_batch(gen.tokenizer, PROMPTS[:2])
    first, second = new_model.state_dict(), old_model.state_dict()
    versions: list[int] = []
    steps: list[int] = []
    reached = threading.Event()

    def on_step(tokens: int) -> None:
        steps.append(tokens)
        if len(steps) == SPLIT:
            reached.set()
            assert gen.engine.batcher.wait_for_update(timeout=60)  # thread A's is queued
            versions.append(gen.update_weights(second))

    def thread_a_updates() -> None:
        assert reached.wait(timeout=60)
        versions.append(gen.update_weights(first))

    gen.on_decode_step = on_step
    finished = gen.iter_generate(batch)
    thread_a = threading.Thread(target=thread_a_updates)
    thread_a.start()
    out = BatchedDataDict.from_batches(
        [output for _, output in sorted(finished)], {"output_ids": gen.pad_id}
    )
    thread_a.join(timeout=60)

    assert sorted(versions) == [1, 2] and gen.policy_version == 2
    for ids, n, k, logprobs, token_versions in rows(out, batch):
        assert token_versions == [0] * (SPLIT + 1) + [2] * (k - SPLIT - 1)
        close(logprobs, forced(old_model, ids, n))  # the second update restored the old weights
    assert gen.decode_stats()[0]["weight_updates"] == 2


def test_a_bad_state_dict_names_every_bad_key_and_generation_goes_on_unchanged(
    untied_policy_dir, new_model
):
    gen = policy(untied_policy_dir)
    batch = make_batch(gen.tokenizer, PROMPTS)
    weights = {k: v.clone() for k, v in gen.model.state_dict().items()}
    before = gen.generate(batch, greedy=True)
    state = new_model.state_dict()
    del state["model.norm.weight"]
    state["lm_head.bias"] = torch.zeros(len(gen.tokenizer))
    state["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 64)

    with pytest.raises(ValueError) as info:
        gen.update_weights(state)

    assert str(info.value).splitlines()[:4] == [
        "update_weights: the state dict does not fit the served model, so nothing was "
        "changed (3 problems):",
        "  - model.norm.weight: missing",
        "  - lm_head.bias: unexpected (the model has no such tensor)",
        "  - model.layers.1.self_attn.q_proj.weight: shape [3, 64], expected [64, 64]",
    ]
    assert gen.policy_version == 0
    after = gen.generate(batch, greedy=True)
    for key in ("output_ids", "logprobs", "policy_versions"):
        assert torch.equal(after[key], before[key]), key
    for key, tensor in gen.model.state_dict().items():
        assert torch.equal(tensor, weights[key]), key


def test_a_folder_and_a_module_load_and_versions_follow_the_rules(
    untied_policy_dir, new_model, tmp_path
):
    gen = policy(untied_policy_dir)
    original = {k: v.clone() for k, v in gen.model.state_dict().items()}
    new_model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with its index

    assert gen.update_weights(str(tmp_path)) == 1
    for key, tensor in new_model.state_dict().items():
        assert torch.equal(gen.model.state_dict()[key], tensor), key
    assert gen.update_weights(AutoModelForCausalLM.from_pretrained(untied_policy_dir), version=5)
    for key, tensor in original.items():
        assert torch.equal(gen.model.state_dict()[key], tensor), key

    assert gen.policy_version == 5
    assert gen.update_weights(new_model.state_dict(), version=5) == 5  # the same is allowed
    assert gen.update_weights(new_model.state_dict()) == 6
    with pytest.raises(ValueError, match=r"would move the policy version backwards from 6"):
        gen.update_weights(original, version=2)
    assert gen.policy_version == 6
    assert torch.equal(gen.model.lm_head.weight, new_model.lm_head.weight)
    with pytest.raises(TypeError, match="must be an int"):
        gen.update_weights(original, version="7")


def test_a_tied_policy_takes_its_state_dict_with_or_without_the_tied_key(tiny_policy_dir):
    gen = policy(tiny_policy_dir)
    other = build_tiny_model(len(gen.tokenizer), seed=1)
    state = other.state_dict()
    assert gen.update_weights(state) == 1
    del state["lm_head.weight"]
    assert gen.update_weights(state) == 2
    assert gen.model.lm_head.weight is gen.model.get_input_embeddings().weight
    assert torch.equal(gen.model.lm_head.weight, other.lm_head.weight)


# --- Ray workers -------------------------------------------------------------------------


def pause_at_step(step: int):
    """Run in a worker actor: its decode loop waits after ``step`` steps of each
    generation until an update is queued, so the update lands right there."""

    def install(worker) -> None:
        count: list[int] = []

        def on_step(tokens: int) -> None:
            count.append(tokens)
            if len(count) == step:
                worker.batcher.wait_for_update(timeout=120)

        worker.on_decode_step = on_step

    return install


def wait_until(condition, timeout: float = 120.0) -> None:
    """Poll ``condition`` (a remote state this process cannot wait on) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class RecordingWorker:
    """A worker handle whose ``stage_weights`` calls record the payload they send."""

    def __init__(self, handle, payloads: list) -> None:
        self.handle, self.payloads = handle, payloads

    def __getattr__(self, name: str):
        method = getattr(self.handle, name)
        if name != "stage_weights":
            return method
        outer = self

        class Recorder:
            @staticmethod
            def remote(payload, version):
                outer.payloads.append(payload)
                return method.remote(payload, version)

        return Recorder


def worker_weights(ray, handles) -> list[dict[str, torch.Tensor]]:
    return ray.get([w.__ray_call__.remote(lambda self: self.model.state_dict()) for w in handles])


@pytest.mark.ray
@pytest.mark.slow
def test_two_workers_update_between_steps_from_one_object_store_copy(
    ray_session, untied_policy_dir, old_model, new_model, tmp_path, monkeypatch
):
    gen = policy(untied_policy_dir, num_workers=2, cpu_threads=1)
    handles = gen.engine.workers
    try:
        batch = make_batch(gen.tokenizer, PROMPTS[:4])
        puts: list = []
        real_put = ray_session.put
        monkeypatch.setattr(ray_session, "put", lambda value: puts.append(value) or real_put(value))
        payloads: list = []
        gen.engine.workers = [RecordingWorker(w, payloads) for w in handles]

        bad = new_model.state_dict()
        bad["model.norm.weight"] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \[3\], expected \[64\]"):
            gen.update_weights(bad)
        assert puts == [] and payloads == []  # checked here, before anything was sent

        ray_session.get([w.__ray_call__.remote(pause_at_step(SPLIT)) for w in handles])
        outputs: list = []
        generating = threading.Thread(target=lambda: outputs.append(gen.generate(batch)))
        generating.start()
        wait_until(lambda: [s["decode_steps"] for s in gen.decode_stats()] == [SPLIT, SPLIT])
        assert gen.update_weights(new_model.state_dict()) == 1
        generating.join(timeout=120)

        assert len(puts) == 1 and len(payloads) == 2
        assert isinstance(payloads[0], ray_session.ObjectRef) and payloads[0] == payloads[1]
        for ids, n, k, logprobs, versions in rows(outputs[0], batch):
            assert k == BUDGET
            assert versions == [0] * (SPLIT + 1) + [1] * (BUDGET - SPLIT - 1)  # keep
            close(logprobs[: SPLIT + 1], forced(old_model, ids, n)[: SPLIT + 1])
            close(logprobs[SPLIT + 1 :], continued(old_model, new_model, ids, n + SPLIT))

        # A folder goes as its path (each worker loads it).
        old_model.save_pretrained(tmp_path)
        assert gen.update_weights(tmp_path) == 2
        assert payloads[2:] == [str(tmp_path)] * 2 and len(puts) == 1
        # One worker refuses (its version is ahead): the other drops what it staged.
        ray_session.get(handles[1].__ray_call__.remote(lambda w: setattr(w, "_policy_version", 9)))
        with pytest.raises(ValueError, match="backwards from 9"):
            gen.update_weights(new_model.state_dict())
        ray_session.get(handles[1].__ray_call__.remote(lambda w: setattr(w, "_policy_version", 2)))
        assert gen.policy_version == 2
        assert ray_session.get(handles[0].__ray_call__.remote(lambda w: w._staged)) is None
        for weights in worker_weights(ray_session, handles):
            for key, tensor in old_model.state_dict().items():
                assert torch.equal(weights[key], tensor), key
        after = gen.generate(batch)
        for ids, n, k, logprobs, versions in rows(after, batch):
            assert versions == [2] * k
            close(logprobs, forced(old_model, ids, n))
    finally:
        gen.engine.workers = handles
        gen.shutdown()
