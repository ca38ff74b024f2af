"""HfGeneration's continuous batching on the tiny policy: rows join a running decode loop,
and every row's result equals generating it alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.generation import PROMPTS, generated, make_batch

BUDGETS = [20, 3, 12, 2, 7]  # rows finish at different steps (row 0 at EOS, step 16)


@pytest.fixture(scope="module")
def policy(untied_policy_dir) -> HfGeneration:
    return HfGeneration({"model_name": str(untied_policy_dir), "max_new_tokens": 24})


def alone(
    policy: HfGeneration, prompt: str, budget: int, stops=None
) -> tuple[list[int], list[float]]:
    """Tokens and logprobs of ``prompt`` generated greedily in a batch of its own."""
    batch = make_batch(
        policy.tokenizer, [prompt], max_new_tokens=torch.tensor([budget]), stop_strings=[stops]
    )
    out = policy.generate(batch, greedy=True)
    n = len(policy.tokenizer(prompt).input_ids)
    end = int(out["unpadded_sequence_lengths"][0])
    return generated(out, 0, n), out["logprobs"][0, n:end].tolist()


def assert_rows_equal_alone(policy, out, prompts, budgets, stops=None) -> None:
    stops = stops or [None] * len(prompts)
    for row, (prompt, budget, stop) in enumerate(zip(prompts, budgets, stops)):
        tokens, logprobs = alone(policy, prompt, budget, stop)
        n = len(policy.tokenizer(prompt).input_ids)
        end = int(out["unpadded_sequence_lengths"][row])
        assert generated(out, row, n) == tokens, row
        torch.testing.assert_close(
            out["logprobs"][row, n:end].tolist(), logprobs, atol=1e-4, rtol=0
        )


def counters(policy: HfGeneration) -> dict[str, int]:
    return policy.decode_stats()[0]


def test_rows_refill_the_batch_as_others_finish(untied_policy_dir):
    policy = HfGeneration(
        {"model_name": str(untied_policy_dir), "max_new_tokens": 24, "micro_batch_size": 2}
    )
    budgets = torch.tensor(BUDGETS)
    out = policy.generate(
        make_batch(policy.tokenizer, PROMPTS, max_new_tokens=budgets), greedy=True
    )

    stats = counters(policy)
    assert stats["requests"] == 5 and stats["peak_rows"] == 2
    # Rows 2, 3 and 4 each took the place of a row that finished (rows 1, 2 and 0, after
    # steps 3, 15 and 16) while the other row was mid-generation.
    assert stats["joined_running"] == 3 and stats["prefills"] == 4
    # Never more than 2 rows, and every step had 2 rows until the last long row ran alone.
    assert stats["decode_steps"] < sum(int(b) for b in out["generation_lengths"])
    assert_rows_equal_alone(policy, out, PROMPTS, BUDGETS)


def join_at_step(policy: HfGeneration, step: int, data, greedy: bool) -> tuple[list, list]:
    """Make ``policy`` queue ``data`` from inside its decode loop's ``step``-th step (on the
    loop's thread, between two steps). Returns the list that gets the rows' iterator and
    the list of each step's row count."""
    calls, late = [], []

    def on_step(tokens: int) -> None:
        calls.append(tokens)
        if len(calls) == step:
            late.append(policy.iter_generate(data, greedy=greedy))

    policy.on_decode_step = on_step
    return late, calls


def rows_of(items) -> dict[int, object]:
    return dict(items)


def assert_row_equals_alone(policy, output, prompt: str, budget: int) -> None:
    tokens, logprobs = alone(policy, prompt, budget)
    n = len(policy.tokenizer(prompt).input_ids)
    end = int(output["unpadded_sequence_lengths"][0])
    assert generated(output, 0, n) == tokens
    torch.testing.assert_close(output["logprobs"][0, n:end].tolist(), logprobs, atol=1e-4, rtol=0)


def test_requests_submitted_while_the_loop_runs_join_it(policy):
    first = make_batch(policy.tokenizer, PROMPTS[:2], max_new_tokens=torch.tensor([20, 20]))
    second = make_batch(policy.tokenizer, PROMPTS[2:], max_new_tokens=torch.tensor([12, 6, 9]))
    before = counters(policy)
    late, _ = join_at_step(policy, 3, second, greedy=True)
    try:
        first_rows = rows_of(policy.iter_generate(first, greedy=True))
    finally:
        policy.on_decode_step = None
    second_rows = rows_of(late[0])
    after = counters(policy)

    assert after["requests"] - before["requests"] == 5
    assert after["joined_running"] - before["joined_running"] == 3
    assert after["prefills"] - before["prefills"] == 2
    for row, budget in enumerate([20, 20]):
        assert_row_equals_alone(policy, first_rows[row], PROMPTS[row], budget)
    for row, budget in enumerate([12, 6, 9]):
        assert_row_equals_alone(policy, second_rows[row], PROMPTS[2 + row], budget)


def test_greedy_rows_joining_sampled_rows_stay_greedy(untied_policy_dir):
    """Rows of a sampled call and of a greedy call share steps; the greedy rows are argmax."""
    policy = HfGeneration({"model_name": str(untied_policy_dir), "max_new_tokens": 24, "seed": 3})
    sampled = make_batch(policy.tokenizer, PROMPTS[:3])
    greedy = make_batch(policy.tokenizer, PROMPTS[3:], max_new_tokens=torch.tensor([10, 10]))
    late, calls = join_at_step(policy, 2, greedy, greedy=True)
    try:
        out = policy.generate(sampled, greedy=False)
    finally:
        policy.on_decode_step = None
    greedy_rows = rows_of(late[0])

    assert calls[2] == 5  # the step after the join ran all five rows
    assert out["generation_lengths"].min() > 0
    for row in range(2):
        assert_row_equals_alone(policy, greedy_rows[row], PROMPTS[3 + row], 10)


def test_concurrent_async_calls_each_equal_generating_alone(policy):
    budgets = [[9, 14], [5, 11, 3]]
    batches = [
        make_batch(policy.tokenizer, PROMPTS[:2], max_new_tokens=torch.tensor(budgets[0])),
        make_batch(policy.tokenizer, PROMPTS[2:], max_new_tokens=torch.tensor(budgets[1])),
    ]

    async def collect(batch) -> dict[int, object]:
        return {row: out async for row, out in policy.generate_async(batch, greedy=True)}

    async def both():
        return await asyncio.gather(*(collect(b) for b in batches))

    first, second = asyncio.run(both())
    assert sorted(first) == [0, 1] and sorted(second) == [0, 1, 2]
    for row, budget in enumerate(budgets[0]):
        assert_row_equals_alone(policy, first[row], PROMPTS[row], budget)
    for row, budget in enumerate(budgets[1]):
        assert_row_equals_alone(policy, second[row], PROMPTS[2 + row], budget)


def test_rows_come_back_as_they_finish(policy):
    batch = make_batch(policy.tokenizer, PROMPTS, max_new_tokens=torch.tensor(BUDGETS))
    order = [row for row, _ in policy.iter_generate(batch, greedy=True)]
    lengths = {row: min(b, 24) for row, b in enumerate(BUDGETS)}
    assert sorted(order) == list(range(5))
    # Shorter budgets finish first (EOS can only end a row earlier than its budget).
    assert order.index(3) < order.index(1) < order.index(0)
    assert lengths[3] < lengths[1] < lengths[0]


def test_closing_the_iterator_early_drops_its_rows_and_the_loop_goes_on(policy):
    batch = make_batch(policy.tokenizer, PROMPTS, max_new_tokens=torch.tensor([24] * 5))
    rows = policy.iter_generate(batch, greedy=True)
    next(rows)
    rows.close()
    out = policy.generate(make_batch(policy.tokenizer, PROMPTS[:1]), greedy=True)
    assert out["generation_lengths"].tolist()[0] > 0
    assert_row_equals_alone(policy, out, PROMPTS[0], 24)


def test_a_sliding_window_model_admits_rows_only_when_its_batch_is_empty(
    tmp_path, untied_policy_dir
):
    """A cache of sliding windows cannot take joining rows; the loop then batches
    statically, with the same results."""
    tokenizer = AutoTokenizer.from_pretrained(untied_policy_dir)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
        sliding_window=8, max_window_layers=0, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    policy = HfGeneration(
        {"model_name": str(tmp_path), "max_new_tokens": 24, "micro_batch_size": 2}
    )
    out = policy.generate(
        make_batch(tokenizer, PROMPTS, max_new_tokens=torch.tensor(BUDGETS)), greedy=True
    )

    stats = counters(policy)
    assert stats["joined_running"] == 0 and stats["prefills"] == 3 and stats["peak_rows"] == 2
    assert_rows_equal_alone(policy, out, PROMPTS, BUDGETS)


def test_a_sampled_row_does_not_depend_on_which_rows_share_its_steps(untied_policy_dir):
    """Each sampled row draws from its own seeded stream: the same call on a fresh instance
    gives the same tokens whether its rows decode together, one at a time, or beside other
    rows that join mid-way."""

    def sampled(micro_batch_size: int, join_greedy_rows: bool = False):
        policy = HfGeneration(
            {"model_name": str(untied_policy_dir), "max_new_tokens": 16, "seed": 7,
             "temperature": 1.5, "micro_batch_size": micro_batch_size}
        )  # fmt: skip
        late = []
        if join_greedy_rows:
            late, _ = join_at_step(policy, 2, make_batch(policy.tokenizer, PROMPTS[3:]), True)
        out = policy.generate(make_batch(policy.tokenizer, PROMPTS[:3]), greedy=False)
        if late:
            rows_of(late[0])
        return out

    together = sampled(micro_batch_size=8)
    for other in (sampled(micro_batch_size=1), sampled(8, join_greedy_rows=True)):
        assert torch.equal(other["output_ids"], together["output_ids"])
        torch.testing.assert_close(other["logprobs"], together["logprobs"], atol=1e-4, rtol=0)
