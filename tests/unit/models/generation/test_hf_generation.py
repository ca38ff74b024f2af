"""HfGeneration on the tiny Qwen3 policy, checked against step-by-step references."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from envloop.config.errors import ConfigError
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_engine import HfEngine
from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig
from envloop.models.generation.hf_worker_pool import HfWorkerPool
from tests.fixtures.generation import PROMPTS, generated, make_batch

EOS_PROMPT = PROMPTS[0]  # with the untied policy, greedy reaches EOS after 16 tokens


@pytest.fixture(scope="module")
def greedy_gen(untied_policy_dir: Path) -> HfGeneration:
    """Shared by greedy tests only: greedy decoding never draws from the generator."""
    return HfGeneration(HfGenerationConfig(model_name=str(untied_policy_dir), max_new_tokens=24))


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_new: int, eos_id: int):
    """Argmax step by step with a full forward pass each step (no cache, no padding)."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(max_new):
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        token = int(logp.argmax())
        tokens.append(token)
        logprobs.append(float(logp[token]))
        ids.append(token)
        if token == eos_id:
            break
    return tokens, logprobs


def reference_logprob(logits: torch.Tensor, token: int, temperature, top_k, top_p) -> float:
    """Log-prob of ``token`` after temperature, top-k, top-p and renormalization, by hand."""
    scaled = logits.double() / temperature
    order = torch.argsort(scaled, descending=True).tolist()
    if top_k is not None:
        order = order[:top_k]
    probs = torch.softmax(scaled[order], dim=0).tolist()
    kept, mass = [], 0.0
    for candidate, p in zip(order, probs):
        kept.append((candidate, p))
        mass += p
        if mass >= top_p:
            break
    total = sum(p for _, p in kept)
    return float(torch.tensor(dict(kept)[token] / total).log())


@torch.no_grad()
def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


# --- log-probabilities ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tied", "untied"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "greedy"),
    [(1.3, None, 1.0, False), (0.8, 40, 0.9, False), (0.7, None, 1.0, True)],
)
def test_logprobs_match_teacher_forced_forward(
    which, temperature, top_k, top_p, greedy, tiny_policy_dir, untied_policy_dir
):
    folder = tiny_policy_dir if which == "tied" else untied_policy_dir
    config = HfGenerationConfig(
        model_name=str(folder),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=12,
        seed=5,
    )
    gen = HfGeneration(config)
    batch = make_batch(gen.tokenizer, PROMPTS[:4])
    out = gen.generate(batch, greedy=greedy)

    for row in range(4):
        start, end = int(batch["input_lengths"][row]), int(out["unpadded_sequence_lengths"][row])
        ids = out["output_ids"][row, :end].tolist()
        logits = teacher_forced_logits(gen.model, ids)
        for pos in range(start, end):
            expected = reference_logprob(logits[pos - 1], ids[pos], temperature, top_k, top_p)
            assert out["logprobs"][row, pos].item() == pytest.approx(expected, abs=1e-4)
            if greedy:
                assert ids[pos] == int(logits[pos - 1].argmax())
        assert torch.all(out["logprobs"][row, :start] == 0)
        assert torch.all(out["logprobs"][row, end:] == 0)
    assert out["logprobs"].dtype == torch.float32


# --- greedy ------------------------------------------------------------------------------


def test_greedy_matches_uncached_reference_token_for_token(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    batch = make_batch(tokenizer, PROMPTS)
    out = greedy_gen.generate(batch, greedy=True)

    for row, prompt in enumerate(PROMPTS):
        prompt_ids = tokenizer(prompt).input_ids
        tokens, logprobs = reference_greedy(
            greedy_gen.model, prompt_ids, 24, tokenizer.eos_token_id
        )
        assert generated(out, row, len(prompt_ids)) == tokens
        got = out["logprobs"][row, len(prompt_ids) : len(prompt_ids) + len(tokens)]
        assert got.tolist() == pytest.approx(logprobs, abs=1e-4)
        assert out["generation_lengths"][row] == len(tokens)
    # the batch mixes samples that end at EOS and samples that run to the budget
    assert out["generation_lengths"].tolist().count(24) not in (0, len(PROMPTS))


def test_batched_greedy_equals_one_by_one_and_micro_batches(greedy_gen, untied_policy_dir):
    batch = make_batch(greedy_gen.tokenizer, PROMPTS)
    together = greedy_gen.generate(batch, greedy=True)
    one_by_one = BatchedDataDict.from_batches(
        [greedy_gen.generate(batch.slice(i, i + 1), greedy=True) for i in range(len(PROMPTS))],
        {"output_ids": greedy_gen.pad_id},
    )
    micro = HfGeneration(
        HfGenerationConfig(model_name=str(untied_policy_dir), max_new_tokens=24, micro_batch_size=2)
    ).generate(batch, greedy=True)

    for other in (one_by_one, micro):
        for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
            assert torch.equal(other[key], together[key]), key
        torch.testing.assert_close(other["logprobs"], together["logprobs"], atol=1e-5, rtol=0)


# --- seeds -------------------------------------------------------------------------------


def test_same_seed_same_samples_and_different_seed_differs(tiny_policy_dir):
    def sample(seed: int, calls: int = 1) -> list[torch.Tensor]:
        config = HfGenerationConfig(
            model_name=str(tiny_policy_dir), temperature=1.5, max_new_tokens=10, seed=seed
        )
        gen = HfGeneration(config)
        batch = make_batch(gen.tokenizer, PROMPTS[:3])
        return [gen.generate(batch)["output_ids"] for _ in range(calls)]

    first, second = sample(seed=3, calls=2)
    assert torch.equal(sample(seed=3)[0], first)
    assert not torch.equal(sample(seed=4)[0], first)
    assert not torch.equal(second, first)  # later calls draw new samples


# --- stopping ----------------------------------------------------------------------------


def test_stop_string_is_kept_and_ends_generation_there(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    prompt = PROMPTS[2]
    prompt_len = len(tokenizer(prompt).input_ids)
    free = generated(
        greedy_gen.generate(make_batch(tokenizer, [prompt]), greedy=True), 0, prompt_len
    )
    stop = tokenizer.decode(free[5:8])
    first_hit = next(n for n in range(1, len(free) + 1) if stop in tokenizer.decode(free[:n]))

    out = greedy_gen.generate(make_batch(tokenizer, [prompt], stop_strings=[[stop]]), greedy=True)

    assert first_hit == 8
    assert generated(out, 0, prompt_len) == free[:8]
    assert tokenizer.decode(generated(out, 0, prompt_len)).endswith(stop)
    assert out["truncated"].tolist() == [False]


def test_stop_string_inside_a_token_stops_at_that_token(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    prompt = PROMPTS[2]
    prompt_len = len(tokenizer(prompt).input_ids)
    free = generated(
        greedy_gen.generate(make_batch(tokenizer, [prompt]), greedy=True), 0, prompt_len
    )
    last_token_text = tokenizer.decode(free[7:8])
    assert len(last_token_text) >= 2, "the test needs a multi-character token"
    stop = tokenizer.decode(free[5:8])[:-1]  # ends one character before token 7 does

    out = greedy_gen.generate(make_batch(tokenizer, [prompt], stop_strings=[[stop]]), greedy=True)

    assert generated(out, 0, prompt_len) == free[:8]
    assert out["truncated"].tolist() == [False]


def test_stop_strings_only_affect_their_own_sample(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[1]]
    free = greedy_gen.generate(make_batch(tokenizer, prompts), greedy=True)
    prompt_len = len(tokenizer(prompts[0]).input_ids)
    stop = tokenizer.decode(generated(free, 0, prompt_len)[5:8])

    stops = [[stop], None, ["this never appears"]]
    out = greedy_gen.generate(make_batch(tokenizer, prompts, stop_strings=stops), greedy=True)

    assert out["generation_lengths"].tolist() == [8, *free["generation_lengths"][1:].tolist()]
    for row in (1, 2):
        n = int(free["unpadded_sequence_lengths"][row])
        assert torch.equal(out["output_ids"][row, :n], free["output_ids"][row, :n])
    assert out["truncated"].tolist() == [False, *free["truncated"][1:].tolist()]


def test_eos_is_kept_counted_and_not_truncated(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    eos = tokenizer.eos_token_id
    prompt_len = len(tokenizer(EOS_PROMPT).input_ids)
    out = greedy_gen.generate(make_batch(tokenizer, [EOS_PROMPT, PROMPTS[1]]), greedy=True)

    tokens = generated(out, 0, prompt_len)
    assert len(tokens) == 16 and tokens[-1] == eos and eos not in tokens[:-1]
    assert out["generation_lengths"][0] == 16
    assert out["unpadded_sequence_lengths"][0] == prompt_len + 16
    assert out["truncated"].tolist() == [False, True]
    assert out["logprobs"][0, prompt_len + 15] < 0
    assert "<|im_end|>" not in tokenizer.decode(tokens, skip_special_tokens=True)
    assert torch.all(out["output_ids"][0, prompt_len + 16 :] == tokenizer.pad_token_id)


def test_per_sample_budgets_and_right_padding(greedy_gen):
    tokenizer = greedy_gen.tokenizer
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3], EOS_PROMPT]
    free = greedy_gen.generate(make_batch(tokenizer, prompts), greedy=True)
    budgets = torch.tensor([0, 3, 100, 16])
    batch = make_batch(tokenizer, prompts, max_new_tokens=budgets)
    out = greedy_gen.generate(batch, greedy=True)

    # 100 is capped by the config's max_new_tokens=24; EOS is the 16th token of the last one
    assert out["generation_lengths"].tolist() == [0, 3, 24, 16]
    assert out["truncated"].tolist() == [True, True, True, False]
    lengths = batch["input_lengths"]
    assert torch.equal(out["unpadded_sequence_lengths"], lengths + out["generation_lengths"])
    assert out["output_ids"].shape[1] == int(out["unpadded_sequence_lengths"].max())
    for row in range(4):
        start, end = int(lengths[row]), int(out["unpadded_sequence_lengths"][row])
        assert torch.equal(out["output_ids"][row, :start], batch["input_ids"][row, :start])
        assert torch.equal(out["output_ids"][row, start:end], free["output_ids"][row, start:end])
        assert torch.all(out["output_ids"][row, end:] == tokenizer.pad_token_id)
        assert torch.all(out["logprobs"][row, :start] == 0)
        assert torch.all(out["logprobs"][row, end:] == 0)
        assert torch.all(out["logprobs"][row, start:end] < 0)


def test_empty_batch_gives_empty_output(greedy_gen):
    batch: BatchedDataDict = BatchedDataDict(
        input_ids=torch.zeros((0, 4), dtype=torch.long),
        input_lengths=torch.zeros(0, dtype=torch.long),
    )
    out = greedy_gen.generate(batch, greedy=True)
    assert out["output_ids"].shape == (0, 4)
    assert out["generation_lengths"].shape == (0,)


# --- errors ------------------------------------------------------------------------------


def test_bad_inputs_raise_errors_naming_the_key(greedy_gen):
    batch = make_batch(greedy_gen.tokenizer, PROMPTS[:2])
    cases = {
        "input_ids: got torch.int32": {"input_ids": batch["input_ids"].int()},
        "input_lengths: values must lie in": {"input_lengths": torch.tensor([0, 3])},
        r"stop_strings: has 1 entries, expected one per sample \(2\)": {"stop_strings": [None]},
        r"stop_strings\[1\]": {"stop_strings": [None, "</a>"]},
        "max_new_tokens: per-sample budgets must be >= 0": {
            "max_new_tokens": torch.tensor([1, -1])
        },
        "input_ids: token ids must lie in": {"input_ids": batch["input_ids"] + 10_000},
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message):
            greedy_gen.generate(BatchedDataDict({**batch, **change}))


def test_config_lists_every_bad_field_with_its_fix():
    with pytest.raises(ConfigError) as info:
        HfGenerationConfig(
            model_name="m",
            device="tpu",
            dtype="fp8",
            temperature=0,
            top_p=1.5,
            top_k=0,
            cpu_threads=0,
        )
    assert [p.split(":")[0] for p in info.value.problems] == [
        "device",
        "dtype",
        "temperature",
        "top_p",
        "top_k",
        "cpu_threads",
    ]
    assert "cpu_threads: must be >= 1, got 0" in str(info.value)
    assert "one of float32, bfloat16, float16" in str(info.value)

    with pytest.raises(ConfigError, match=r"(?s)max_new_token: unknown option. Did you mean"):
        HfGenerationConfig.from_mapping({"model_name": "m", "max_new_token": 5})


def test_a_plain_mapping_is_the_same_config_as_the_typed_one(tiny_policy_dir):
    options = {"model_name": str(tiny_policy_dir), "max_new_tokens": 24, "top_k": 5}
    assert HfGeneration(options).config == HfGenerationConfig(**options)
    with pytest.raises(ConfigError) as info:  # checked before anything loads
        HfGeneration({"model_name": str(tiny_policy_dir), "max_new_token": 24, "top_k": 0})
    assert info.value.problems == [
        "top_k: must be >= 1, got 0",
        "max_new_token: unknown option. Did you mean 'max_new_tokens'?",
    ]
    with pytest.raises(ConfigError, match="(?s)HfGenerationConfig:.*expected a mapping, got str"):
        HfGeneration(str(tiny_policy_dir))


def test_tokenizer_without_pad_token_raises_with_the_fix(tiny_policy_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    config = HfGenerationConfig(model_name=str(tiny_policy_dir), tokenizer_name=str(tmp_path))
    with pytest.raises(ValueError, match=r"has no pad token.*tokenizer\.pad_token = "):
        HfGeneration(config)


def test_on_decode_step_counts_each_steps_tokens(greedy_gen):
    steps: list[int] = []
    greedy_gen.on_decode_step = steps.append
    try:
        out = greedy_gen.generate(make_batch(greedy_gen.tokenizer, PROMPTS), greedy=True)
    finally:
        greedy_gen.on_decode_step = None
    lengths = out["generation_lengths"].tolist()
    assert steps == [sum(n > k for n in lengths) for k in range(max(lengths))]
    assert sum(steps) == sum(lengths)


def test_in_process_the_facade_hands_every_call_to_its_engine(greedy_gen):
    engine = greedy_gen.engine
    assert isinstance(engine, HfEngine)
    assert greedy_gen.model is engine.model and greedy_gen.pad_id == engine.pad_id
    batch = make_batch(greedy_gen.tokenizer, PROMPTS[:2])
    steps: list[int] = []
    greedy_gen.on_decode_step = steps.append
    try:
        assert engine.on_decode_step == steps.append
        ours, direct = greedy_gen.generate(batch, greedy=True), engine.generate(batch, greedy=True)
    finally:
        greedy_gen.on_decode_step = None
    assert engine.on_decode_step is None and steps  # both calls counted their steps
    for key in ("output_ids", "logprobs", "generation_lengths"):
        assert torch.equal(ours[key], direct[key]), key
    assert greedy_gen.decode_stats() == engine.decode_stats()
    assert greedy_gen.policy_version == engine.policy_version == 0


def test_cpu_generation_sets_this_process_torch_threads(tiny_policy_dir):
    before = torch.get_num_threads()
    try:
        assert HfGenerationConfig(model_name="m").cpu_threads == 1
        HfGeneration(HfGenerationConfig(model_name=str(tiny_policy_dir), cpu_threads=2))
        assert torch.get_num_threads() == 2
        HfGeneration(HfGenerationConfig(model_name=str(tiny_policy_dir), cpu_threads=None))
        assert torch.get_num_threads() == 2  # None leaves the count as it was
        HfGeneration(HfGenerationConfig(model_name=str(tiny_policy_dir)))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# --- Ray workers -------------------------------------------------------------------------


async def collect_async(policy: HfGeneration, batch: BatchedDataDict) -> dict[int, BatchedDataDict]:
    return {row: output async for row, output in policy.generate_async(batch, greedy=True)}


@pytest.mark.ray
@pytest.mark.slow
def test_two_ray_workers_match_in_process_greedy(ray_session, greedy_gen, untied_policy_dir):
    config = HfGenerationConfig(
        model_name=str(untied_policy_dir),
        max_new_tokens=24,
        num_workers=2,
        micro_batch_size=2,
        cpu_threads=2,  # Ray's own default in an actor reserving 1 CPU would be 1
    )
    workers = HfGeneration(config)
    try:
        assert workers.model is None and isinstance(workers.engine, HfWorkerPool)
        with pytest.raises(NotImplementedError, match="iterate over generate_async"):
            workers.iter_generate(make_batch(workers.tokenizer, PROMPTS[:1]))
        threads = [
            w.__ray_call__.remote(lambda _: torch.get_num_threads()) for w in workers.engine.workers
        ]
        assert ray_session.get(threads) == [2, 2]
        assert workers.prepare_for_generation()
        stops = [None, None, ["this never appears"], None, None]
        batch = make_batch(workers.tokenizer, PROMPTS, stop_strings=stops)
        remote = workers.generate(batch, greedy=True)
        local = greedy_gen.generate(batch, greedy=True)
        before = [stats["requests"] for stats in workers.decode_stats()]
        streamed = asyncio.run(collect_async(workers, batch))
        after = [stats["requests"] for stats in workers.decode_stats()]
    finally:
        workers.shutdown()
    # Least-loaded routing with nothing else outstanding alternates between the workers.
    assert [a - b for a, b in zip(after, before)] == [3, 2]
    assert sorted(streamed) == list(range(len(PROMPTS)))
    for row, output in streamed.items():
        n = int(local["unpadded_sequence_lengths"][row])
        assert output["output_ids"][0, :n].tolist() == local["output_ids"][row, :n].tolist()
        torch.testing.assert_close(
            output["logprobs"][0, :n], local["logprobs"][row, :n], atol=1e-5, rtol=0
        )
    for key in ("output_ids", "generation_lengths", "unpadded_sequence_lengths", "truncated"):
        assert torch.equal(remote[key], local[key]), key
    torch.testing.assert_close(remote["logprobs"], local["logprobs"], atol=1e-5, rtol=0)
