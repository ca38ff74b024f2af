"""HfGeneration on a CUDA device: sampled tokens' logprobs are those of the weights that
produced them (teacher-forced on the same device, fp32), also across weight updates that
come from CPU tensors and land mid-generation, for a text model and a tiny VLM.

Skipped without CUDA; run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
)
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.generation import PROMPTS, make_batch
from tests.fixtures.images import noise_image
from tests.fixtures.tiny_vlms import SAVERS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BUDGET, SPLIT = 10, 4


@pytest.fixture(autouse=True)
def exact_fp32():
    """Plain fp32 matmuls (no TF32), so 1e-4 is a fair tolerance."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def cuda_policy(folder, **options) -> HfGeneration:
    config = {"model_name": str(folder), "device": "cuda", "max_new_tokens": BUDGET, "seed": 3}
    return HfGeneration({**config, **options})


@torch.no_grad()
def forced(model, ids: list[int], start: int) -> torch.Tensor:
    """Teacher-forced logprobs of ids[start:] under ``model`` (on its device), on the CPU."""
    logits = model(torch.tensor([ids], device=model.device)).logits[0, start - 1 : -1].float()
    target = torch.tensor(ids[start:], device=model.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, target)[:, 0].cpu()


def perturbed(model) -> dict[str, torch.Tensor]:
    """A CPU state dict of ``model``'s architecture with every tensor moved by noise."""
    generator = torch.Generator().manual_seed(2)
    return {
        key: value.detach().cpu() + torch.randn(value.shape, generator=generator) * 0.05
        for key, value in model.state_dict().items()
    }


def generated_rows(out: BatchedDataDict, batch: BatchedDataDict):
    for row in range(out.size):
        n, end = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        ids = out["output_ids"][row, :end].tolist()
        yield ids, n, out["logprobs"][row, n:end], out["policy_versions"][row, n:end].tolist()


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_cuda_rows_in_flight_switch_to_cpu_weights_where_the_update_lands(untied_policy_dir, mode):
    gen = cuda_policy(untied_policy_dir, kv_cache_on_update=mode)
    old = AutoModelForCausalLM.from_pretrained(untied_policy_dir).to("cuda").eval()
    new_weights = perturbed(old)
    new = AutoModelForCausalLM.from_pretrained(untied_policy_dir).eval()
    new.load_state_dict(new_weights)
    new = new.to("cuda")
    steps: list[int] = []

    def on_step(tokens: int) -> None:
        steps.append(tokens)
        if len(steps) == SPLIT:
            assert gen.update_weights(new_weights) == 1

    gen.on_decode_step = on_step
    batch = make_batch(gen.tokenizer, PROMPTS[:3])
    out = gen.generate(batch)
    old_tokens = SPLIT + 1 if mode == "keep" else SPLIT
    for ids, n, logprobs, versions in generated_rows(out, batch):
        k = len(versions)
        assert versions == [0] * old_tokens + [1] * (k - old_tokens)
        torch.testing.assert_close(
            logprobs[:old_tokens], forced(old, ids, n)[:old_tokens], atol=1e-4, rtol=0
        )
        if mode == "recompute":
            torch.testing.assert_close(
                logprobs[old_tokens:], forced(new, ids, n)[old_tokens:], atol=1e-4, rtol=0
            )
    after = gen.generate(batch)  # every token of a later call: the new weights
    for ids, n, logprobs, versions in generated_rows(after, batch):
        assert versions == [1] * len(versions)
        torch.testing.assert_close(logprobs, forced(new, ids, n), atol=1e-4, rtol=0)
    assert next(gen.model.parameters()).device.type == "cuda"


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_cuda_vlm_update_from_a_folder(tmp_path, family):
    old_dir = SAVERS[family](tmp_path / "old", seed=0)
    new_dir = SAVERS[family](tmp_path / "new", seed=1)
    gen = cuda_policy(old_dir, max_new_tokens=6)
    content = [{"type": "image", "image": noise_image(0, 64, 96)}, {"type": "text", "text": "?"}]
    log = get_formatted_message_log(
        [{"role": "user", "content": content}], gen.processor, add_generation_prompt=True
    )
    flat, lengths = batched_message_log_to_flat_message(
        [log], pad_value_dict={"token_ids": gen.pad_id}
    )
    batch = BatchedDataDict(
        input_ids=flat["token_ids"], input_lengths=lengths,
        **{k: v for k, v in flat.items() if k not in ("token_ids", "content", "role")},
    )  # fmt: skip
    before = gen.generate(batch)
    assert gen.update_weights(str(new_dir)) == 1
    after = gen.generate(batch)
    assert before["policy_versions"].max() == 0
    n = int(lengths[0])
    assert after["policy_versions"][0, n : int(after["unpadded_sequence_lengths"][0])].min() == 1
    assert not torch.equal(before["logprobs"], after["logprobs"])
    assert bool((after["logprobs"][0, n:] < 0).all())
