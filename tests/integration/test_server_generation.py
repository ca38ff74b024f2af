"""ServerGeneration against a real llama-server (built by scripts/build_llama_server.sh)
serving the bundled policy converted to an f32 GGUF: the tokens recorded are the server's,
logprobs agree with a teacher-forced pass of the same weights, greedy text equals
HfGeneration's, stop strings and budgets hold, multi-turn rollouts are token-exact, and a
server killed and restarted mid-rollout loses no sample.

Tolerance of the logprob comparisons: llama.cpp computes with its own f32 kernels
(different summation order, SIMD exp/softmax approximations), so its logits differ from
torch's by about 1e-4 of their spread; measured on the demo prompts, the log-probability
of a sampled token differs from the teacher-forced value by at most 5e-3 (the largest
differences are at unlikely tokens, log p < -3) and greedy tokens' by at most 3e-4.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from envloop.data.chat_templates import ObservationRenderer
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.bundled import resolve_model
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.sampling import sampling_logprobs
from envloop.models.generation.server_dialects import GenerationRequest, LlamaCppDialect, Sampling
from envloop.models.generation.server_generation import ServerGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.envs import EchoEnv
from tests.fixtures.llama_server import LlamaServer, converted_gguf
from tests.integration.test_llama_server import demo_prompts

pytestmark = pytest.mark.server
SAMPLED_TOLERANCE = 1e-2
GREEDY_TOLERANCE = 1e-3
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def gguf() -> Path:
    return converted_gguf(Path(resolve_model("bundled:policy")))


@pytest.fixture(scope="module")
def server(gguf):
    running = LlamaServer(gguf).start()
    yield running
    running.stop()


def server_policy(urls: list[str], **settings) -> ServerGeneration:
    config = {"base_urls": urls, "dialect": "llamacpp", "tokenizer": "bundled:policy",
              "max_new_tokens": MAX_NEW_TOKENS, **settings}  # fmt: skip
    return ServerGeneration(config)


@pytest.fixture(scope="module")
def policy(server):
    backend = server_policy([server.url])
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def hf() -> HfGeneration:
    return HfGeneration({"model_name": "bundled:policy", "max_new_tokens": MAX_NEW_TOKENS})


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(
        resolve_model("bundled:policy"), dtype=torch.float32
    ).eval()


def prompt_batch(prompts: list[list[int]], **columns) -> BatchedDataDict:
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    lengths = torch.tensor([len(p) for p in prompts])
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, **columns)


def generated(out: BatchedDataDict, row: int, prompt: list[int]) -> list[int]:
    end = len(prompt) + int(out["generation_lengths"][row])
    return out["output_ids"][row, len(prompt) : end].tolist()


def teacher_forced(model, prompt: list[int], tokens: list[int], sampling) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return sampling_logprobs(logits, *sampling)[torch.arange(len(tokens)), torch.tensor(tokens)]


def reported(out: BatchedDataDict, row: int, prompt: list[int]) -> torch.Tensor:
    return out["logprobs"][row, len(prompt) : len(prompt) + int(out["generation_lengths"][row])]


def test_greedy_tokens_are_the_servers_and_equal_hf_generation(server, policy, hf):
    prompts = demo_prompts(policy.tokenizer, 8)
    out = policy.generate(prompt_batch(prompts), greedy=True)
    expected = hf.generate(prompt_batch(prompts), greedy=True)
    for row, prompt in enumerate(prompts):
        direct = server.post(
            "/completion",
            {"prompt": prompt, "n_predict": MAX_NEW_TOKENS, "temperature": 0,
             "return_tokens": True},
        )["tokens"]  # fmt: skip
        assert generated(out, row, prompt) == direct == generated(expected, row, prompt)
        text = policy.tokenizer.decode(direct)
        assert text == hf.tokenizer.decode(generated(expected, row, prompt))
    assert torch.allclose(out["logprobs"], expected["logprobs"], atol=GREEDY_TOLERANCE)
    assert out["generation_error"] == [None] * len(prompts)


@pytest.mark.parametrize(
    "settings", [{}, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}], ids=["plain", "filtered"]
)
def test_sampled_logprobs_match_teacher_forcing_of_the_same_weights(server, model, settings):
    backend = server_policy([server.url], seed=11, **settings)
    try:
        prompts = demo_prompts(backend.tokenizer, 8)
        out = backend.generate(prompt_batch(prompts))
    finally:
        backend.shutdown()
    sampling = (settings.get("temperature", 1.0), settings.get("top_k"), settings.get("top_p", 1))
    worst = 0.0
    for row, prompt in enumerate(prompts):
        tokens = generated(out, row, prompt)
        assert tokens, "every row generated something"
        difference = reported(out, row, prompt) - teacher_forced(model, prompt, tokens, sampling)
        worst = max(worst, float(difference.abs().max()))
    assert worst < SAMPLED_TOLERANCE


def test_stop_strings_end_replies_and_keep_every_tokens_logprob(policy, hf, model):
    prompts = demo_prompts(policy.tokenizer, 4)
    free = policy.generate(prompt_batch(prompts), greedy=True)
    stops = []
    for row, prompt in enumerate(prompts):  # a stop string from the middle of each reply
        text = policy.tokenizer.decode(generated(free, row, prompt))
        stops.append([text[6:9]])
    out = policy.generate(prompt_batch(prompts, stop_strings=stops), greedy=True)
    for row, prompt in enumerate(prompts):
        tokens = generated(out, row, prompt)
        text = policy.tokenizer.decode(tokens)
        stop = stops[row][0]
        assert stop in text and stop not in policy.tokenizer.decode(tokens[:-1])
        assert tokens == generated(free, row, prompt)[: len(tokens)]
        assert not out["truncated"][row]
        # llama.cpp drops the stop string's probabilities from its answer: recovered
        expected = teacher_forced(model, prompt, tokens, (1.0, None, 1.0))
        assert torch.allclose(reported(out, row, prompt), expected, atol=GREEDY_TOLERANCE)
    assert policy.request_stats()["score_requests"] > 0


def test_budgets_cap_each_row(policy):
    prompts = demo_prompts(policy.tokenizer, 3)
    batch = prompt_batch(prompts, max_new_tokens=torch.tensor([3, 0, 100]))
    out = policy.generate(batch, greedy=True)
    lengths = out["generation_lengths"].tolist()
    assert lengths[:2] == [3, 0] and 0 < lengths[2] <= MAX_NEW_TOKENS
    assert out["truncated"].tolist()[:2] == [True, True]


def test_a_prompts_samples_go_as_one_request_and_get_their_own_requests_tokens(server):
    backend = server_policy([server.url], seed=3, max_new_tokens=24, temperature=1.5)
    try:
        prompts = demo_prompts(backend.tokenizer, 2)
        rows = [prompts[0]] * 4 + [prompts[1]] * 4  # two prompts' samples, as GRPO groups
        out = backend.generate(prompt_batch(rows))
        stats = backend.request_stats()
    finally:
        backend.shutdown()
    dialect, sampling = LlamaCppDialect(), Sampling(1.5, 1.0, None, greedy=False)
    for row, prompt in enumerate(rows):  # each row as a request of its own, with its seed
        seed = (3 * 1_000_003 + row + 1) % 2**31
        alone = server.post(
            "/completion", dialect.body(GenerationRequest(prompt, 24, None, seed), sampling)
        )
        assert generated(out, row, prompt) == alone["tokens"]
    assert len({tuple(generated(out, row, prompt)) for row, prompt in enumerate(rows)}) > 2
    assert stats["requests"] - stats["score_requests"] == 2  # 4 slots: 4 rows per request
    assert out["generation_error"] == [None] * len(rows)


def test_rows_of_other_prompts_go_as_one_request_where_seeds_do_not_matter(server, policy, model):
    def run(greedy: bool, **settings) -> tuple[BatchedDataDict, int]:
        backend = server_policy([server.url], **settings)
        try:
            out = backend.generate(prompt_batch(prompts), greedy=greedy)
            stats = backend.request_stats()
        finally:
            backend.shutdown()
        assert out["generation_error"] == [None] * len(prompts)
        return out, stats["requests"] - stats["score_requests"]

    prompts = demo_prompts(policy.tokenizer, 8)
    # greedy: 8 prompts as 2 requests of 4 (the server's slots), each row the tokens of a
    # request of its own
    out, requests = run(True)
    assert requests == 2
    for row, prompt in enumerate(prompts):
        body = {"prompt": prompt, "n_predict": MAX_NEW_TOKENS, "temperature": 0,
                "return_tokens": True}  # fmt: skip
        assert generated(out, row, prompt) == server.post("/completion", body)["tokens"]
    # unseeded sampling: listed too; each row's log-probabilities are its tokens' under
    # the weights (teacher forcing)
    out, requests = run(False, seed=None)
    assert requests == 2
    for row, prompt in enumerate(prompts):
        tokens = generated(out, row, prompt)
        expected = teacher_forced(model, prompt, tokens, (1.0, None, 1.0))
        assert torch.allclose(reported(out, row, prompt), expected, atol=SAMPLED_TOLERANCE)
    # seeded sampling: a request per row (a list would give every prompt one seed)
    _, requests = run(False, seed=4)
    assert requests == 8


def echo_batch(tokenizer, count: int):
    samples = [
        {"task": "echo", "prompt": f"What is {n} + {n + 1}?", "metadata": {"reply": "Again?"}}
        for n in range(count)
    ]
    return make_batch(tokenizer, samples)


def test_multi_turn_rollouts_are_token_exact_and_equal_hf_generation(policy, hf):
    batch = echo_batch(policy.tokenizer, 4)
    args = ({"echo": EchoEnv()}, max(batch["length"]) + 120)
    final, metrics = run_multi_turn_rollout(
        policy, batch, policy.tokenizer, *args, max_rollout_turns=3, greedy=True
    )
    reference, _ = run_multi_turn_rollout(
        hf, batch, hf.tokenizer, *args, max_rollout_turns=3, greedy=True
    )
    for log, expected in zip(final["message_log"], reference["message_log"]):
        assert [m["role"] for m in log] == [m["role"] for m in expected]
        for message, other in zip(log, expected):
            assert torch.equal(message["token_ids"], other["token_ids"])
    assert metrics["generation_error_rate"] == 0.0 and metrics["total_turns"] > 4

    streamed, _ = asyncio.run(
        run_async_multi_turn_rollout(
            policy, batch, policy.tokenizer, *args, max_rollout_turns=3, greedy=True
        )
    )
    for log, expected in zip(streamed["message_log"], final["message_log"]):
        assert all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in zip(log, expected))


def test_a_failed_request_fails_only_its_sample(policy):
    tokenizer = policy.tokenizer
    batch = echo_batch(tokenizer, 3)
    long_prompt = "Add these numbers. " + " ".join(str(n) for n in range(400))
    batch["message_log"][1] = make_batch(tokenizer, [{"task": "echo", "prompt": long_prompt}])[
        "message_log"
    ][0]  # longer than the server's 512-token context per slot
    final, metrics = run_multi_turn_rollout(
        policy, batch, tokenizer, {"echo": EchoEnv()}, 4096, max_rollout_turns=2, greedy=True
    )
    errors = final["generation_error"]
    assert errors[0] is None and errors[2] is None
    assert errors[1].startswith("generation failed: ") and "HTTP 400" in errors[1]
    assert final["loss_multiplier"] == [1.0, 0.0, 1.0]
    assert final["num_turns"].tolist() == [2, 0, 2]
    assert metrics["generation_error_rate"] == pytest.approx(1 / 3)


def test_a_server_killed_and_restarted_mid_rollout_loses_no_sample(gguf, hf):
    first, second = LlamaServer(gguf).start(), LlamaServer(gguf).start()
    backend = server_policy([first.url, second.url], max_retries=8, retry_backoff_s=0.2)
    restarted = threading.Event()
    bring_back = threading.Thread(target=lambda: (time.sleep(1.0), second.start()))

    def restart(progress) -> None:  # after the first finished turn: kill, then bring back
        if progress.turns and not restarted.is_set():
            restarted.set()
            second.stop()
            bring_back.start()

    try:
        batch = echo_batch(backend.tokenizer, 8)
        args = ({"echo": EchoEnv()}, max(batch["length"]) + 200)
        final, metrics = asyncio.run(
            run_async_multi_turn_rollout(
                backend, batch, backend.tokenizer, *args, max_rollout_turns=4, greedy=True,
                on_turn=restart,
            )
        )  # fmt: skip
        reference, _ = run_multi_turn_rollout(
            hf, batch, hf.tokenizer, *args, max_rollout_turns=4, greedy=True
        )
        assert restarted.is_set()
        assert final["generation_error"] == [None] * 8 and metrics["generation_error_rate"] == 0
        assert final["num_turns"].tolist() == [4] * 8
        for log, expected in zip(final["message_log"], reference["message_log"]):
            assert all(torch.equal(a["token_ids"], b["token_ids"]) for a, b in zip(log, expected))
        # once back and past its set-aside, the restarted server is used again (an
        # answered request resets its failure count)
        bring_back.join()
        slot = backend._client.router.servers[1]
        time.sleep(max(0.0, slot.down_until - time.monotonic()))
        prompts = demo_prompts(backend.tokenizer, 6)
        out = backend.generate(prompt_batch(prompts), greedy=True)
        assert out["generation_error"] == [None] * 6
        assert slot.failures == 0
        assert backend.request_stats()["retries"] > 0
    finally:
        backend.shutdown()
        first.stop()
        second.stop()


def test_a_server_that_gives_no_token_ids_is_refused_at_start_up(server):
    # llama-server also serves /v1/completions, but ignores return_tokens_as_token_ids
    with pytest.raises(
        RuntimeError, match=r"'vllm' dialect\) answered the probe request without usable token ids"
    ):
        server_policy([server.url], dialect="vllm")
    with pytest.raises(RuntimeError, match="probe request failed.*HTTP 404"):
        server_policy([server.url], dialect="sglang")


@pytest.mark.parametrize("dialect", ["llamacpp", "vllm"])  # vllm: asks /v1/models first
def test_an_unreachable_server_fails_start_up_with_the_url(dialect):
    with pytest.raises(RuntimeError, match=r"http://127\.0\.0\.1:9/? did not answer"):
        server_policy(["http://127.0.0.1:9"], dialect=dialect, startup_timeout_s=0.5)


def test_the_policy_chat_template_settings_reach_the_tokenizer_it_renders_with(server):
    switch = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )  # Qwen3's switch on ChatML
    backend = server_policy(
        [server.url], chat_template=switch, chat_template_kwargs={"enable_thinking": False}
    )
    try:
        observation = ObservationRenderer(backend.tokenizer).render("tool", "42", True)
        assert observation == (
            "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
    finally:
        backend.shutdown()
