"""Each dialect's request body, and how it reads answers written out here as each server
returns them, fields we ignore included.

vLLM and SGLang do not run on this machine: their answers follow vLLM's ``CompletionResponse``
(0.11, with ``return_token_ids``) and SGLang's ``/generate`` output. The tokens,
probabilities, stop fields and generation settings of the llama.cpp answers marked "recorded"
came from the llama-server that ``scripts/build_llama_server.sh`` builds, serving the bundled
policy (their timings and prompt text are the first one's); the others change one thing in
that shape (a gap mid-way through a character, entries out of order).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from envloop.config.errors import ConfigError
from envloop.models.generation.server_config import ServerGenerationConfig
from envloop.models.generation.server_dialects import (
    GenerationRequest,
    LlamaCppDialect,
    MalformedReply,
    Reply,
    Sampling,
    SglangDialect,
    VllmDialect,
)

REQUEST = GenerationRequest(prompt=[785, 6722, 315, 9625, 374], budget=12, stops=["</a>"], seed=5)
SAMPLED = Sampling(temperature=0.7, top_p=0.9, top_k=20, greedy=False)
GREEDY = Sampling(temperature=0.7, top_p=0.9, top_k=20, greedy=True)  # the knobs are ignored
UNFILTERED = Sampling(temperature=0.7, top_p=0.9, top_k=None, greedy=False)
MODEL = "Qwen/Qwen3-0.6B"
IM_END, ENDOFTEXT = 151645, 151643

# ---------------------------------------------------------------------------------------------
# vLLM /v1/completions


def vllm_answer(
    tokens: list[int],
    logprobs: list[float],
    finish_reason: str = "stop",
    stop_reason: Any = None,
    text: str = " Paris.<|im_end|>",
) -> dict[str, Any]:
    """vLLM's answer to our body (``logprobs: 0``, ``return_tokens_as_token_ids`` and
    ``return_token_ids``): one choice, each token written ``token_id:<id>``, the text offsets
    counted in those placeholders, the sampled token its own top log-probability."""
    names = [f"token_id:{t}" for t in tokens]
    offsets = [sum(len(n) for n in names[:i]) for i in range(len(names))]
    return {
        "id": "cmpl-9c1f6e0b2d7a4e3f8b5a1c0d9e8f7a6b",
        "object": "text_completion",
        "created": 1754300142,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": logprobs,
                    "tokens": names,
                    "top_logprobs": [{n: lp} for n, lp in zip(names, logprobs)],
                },
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": tokens,
                "prompt_logprobs": None,
                "prompt_token_ids": REQUEST.prompt,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 5,
            "total_tokens": 5 + len(tokens),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
    }


def old_vllm_answer(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The same answer from a vLLM before 0.10.2, which has no ``return_token_ids``."""
    payload = vllm_answer(*args, **kwargs)
    del payload["choices"][0]["token_ids"], payload["choices"][0]["prompt_token_ids"]
    return payload


VLLM_EOS = vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
VLLM_STOP_STRING = vllm_answer(
    [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003],
    stop_reason="</a>", text=" Paris.</a>",
)  # fmt: skip
VLLM_LENGTH = vllm_answer(
    [12095, 13, 576, 6722], [-0.0123, -0.4051, -2.5, -0.75], finish_reason="length",
    text=" Paris. The capital",
)  # fmt: skip


def test_vllm_eos_finish():
    reply = VllmDialect(MODEL).parse(VLLM_EOS)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_vllm_stop_token_finish_is_eos():
    """An extra EOS of the model's generation config ends with its id as stop_reason."""
    payload = vllm_answer([12095, 13, ENDOFTEXT], [-0.01, -0.4, -0.02], stop_reason=ENDOFTEXT)
    assert VllmDialect(MODEL).parse(payload) == Reply(
        [12095, 13, ENDOFTEXT], [-0.01, -0.4, -0.02], "eos", 5
    )


def test_vllm_stop_string_finish():
    reply = VllmDialect(MODEL).parse(VLLM_STOP_STRING)
    assert reply == Reply(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003], "stop", 5
    )


def test_vllm_length_finish():
    reply = VllmDialect(MODEL).parse(VLLM_LENGTH)
    assert reply == Reply([12095, 13, 576, 6722], [-0.0123, -0.4051, -2.5, -0.75], "length", 5)


@pytest.mark.parametrize("token_ids", ["absent", None], ids=["absent", "null"])
def test_older_vllm_gives_ids_in_the_token_placeholders(token_ids):
    payload = old_vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
    if token_ids is None:
        payload["choices"][0]["token_ids"] = None
    reply = VllmDialect(MODEL).parse(payload)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_vllm_token_ids_disagreeing_with_the_placeholders_are_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["token_ids"] = [12095, 14, IM_END]
    with pytest.raises(MalformedReply, match="token_ids and logprobs.tokens disagree"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_without_placeholders_names_return_tokens_as_token_ids():
    payload = old_vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
    payload["choices"][0]["logprobs"]["tokens"] = [" Paris", ".", "<|im_end|>"]
    with pytest.raises(MalformedReply) as error:
        VllmDialect(MODEL).parse(payload)
    assert str(error.value) == (
        "logprobs.tokens holds ' Paris', not 'token_id:<id>': the server ignored "
        "return_tokens_as_token_ids (vLLM >= 0.5.0 honours it)"
    )


def test_vllm_without_logprobs_is_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["logprobs"] = None
    with pytest.raises(MalformedReply, match="'logprobs' missing or not a dict"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_fewer_logprobs_than_tokens_are_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    del payload["choices"][0]["logprobs"]["token_logprobs"][-1]
    with pytest.raises(MalformedReply, match="^3 token ids but 2 log-probabilities$"):
        VllmDialect(MODEL).parse(payload)


@pytest.mark.parametrize("value", [float("nan"), None, "-0.4"], ids=["nan", "null", "string"])
def test_vllm_logprobs_that_are_not_numbers_are_malformed(value):
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["logprobs"]["token_logprobs"][1] = value
    with pytest.raises(MalformedReply, match=r"^log-probability .* is not a number$"):
        VllmDialect(MODEL).parse(payload)


@pytest.mark.parametrize("finish_reason", ["abort", None])
def test_vllm_other_finish_reasons_are_malformed(finish_reason):
    payload = vllm_answer([12095], [-0.0123], finish_reason=finish_reason)
    with pytest.raises(MalformedReply, match="expected 'stop' or 'length'"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_sampled_request_body():
    assert VllmDialect(MODEL).body(REQUEST, SAMPLED) == {
        "prompt": [785, 6722, 315, 9625, 374],
        "max_tokens": 12,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["</a>"],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
        "seed": 5,
        "model": MODEL,
    }


def test_vllm_greedy_request_body_without_model_or_stops():
    request = GenerationRequest(prompt=[785, 6722], budget=3, stops=None, seed=5)
    assert VllmDialect(None).body(request, GREEDY) == {
        "prompt": [785, 6722],
        "max_tokens": 3,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop": [],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
        "seed": 5,
    }


def test_vllm_top_k_off_and_no_seed():
    request = GenerationRequest(prompt=[785], budget=3, stops=None, seed=None)
    body = VllmDialect(MODEL).body(request, UNFILTERED)
    assert (body["top_k"], body["top_p"], body["temperature"]) == (-1, 0.9, 0.7)
    assert "seed" not in body


# ---------------------------------------------------------------------------------------------
# SGLang /generate


def sglang_answer(
    tokens: list[int], logprobs: list[float], finish_reason: dict[str, Any],
    text: str = " Paris.<|im_end|>",
) -> dict[str, Any]:  # fmt: skip
    """SGLang's answer to our body (``return_logprob``, ``logprob_start_len: -1``,
    ``top_logprobs_num: 0``): each output token's ``[logprob, id, None]`` in meta_info."""
    return {
        "text": text,
        "output_ids": tokens,
        "meta_info": {
            "id": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
            "finish_reason": finish_reason,
            "prompt_tokens": 5,
            "weight_version": "default",
            "completion_tokens": len(tokens),
            "cached_tokens": 4,
            "e2e_latency": 0.0417,
            "input_token_logprobs": [],
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens, logprobs)],
        },
    }


SGLANG_EOS = sglang_answer(
    [12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], {"type": "stop", "matched": IM_END}
)


def test_sglang_eos_finish():
    reply = SglangDialect().parse(SGLANG_EOS)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_sglang_stop_string_finish():
    payload = sglang_answer(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003],
        {"type": "stop", "matched": "</a>"}, text=" Paris.</a>",
    )  # fmt: skip
    reply = SglangDialect().parse(payload)
    assert reply == Reply(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003], "stop", 5
    )


def test_sglang_length_finish():
    payload = sglang_answer(
        [12095, 13, 576], [-0.0123, -0.4051, -2.5], {"type": "length", "length": 3},
        text=" Paris. The",
    )  # fmt: skip
    assert SglangDialect().parse(payload) == Reply(
        [12095, 13, 576], [-0.0123, -0.4051, -2.5], "length", 5
    )


def test_sglang_abort_is_malformed():
    payload = sglang_answer(
        [12095], [-0.0123],
        {"type": "abort", "message": "Abort before prefill", "status_code": 500,
         "err_type": None},
    )  # fmt: skip
    with pytest.raises(MalformedReply, match="expected type 'stop' or 'length'"):
        SglangDialect().parse(payload)


def test_older_sglang_gives_ids_in_the_logprob_entries():
    payload = copy.deepcopy(SGLANG_EOS)
    del payload["output_ids"]
    reply = SglangDialect().parse(payload)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_sglang_output_ids_disagreeing_with_the_logprob_entries_are_malformed():
    payload = copy.deepcopy(SGLANG_EOS)
    payload["output_ids"] = [12095, 13]
    with pytest.raises(MalformedReply, match="output_ids and meta_info.output_token_logprobs"):
        SglangDialect().parse(payload)


def test_sglang_logprob_entries_without_ids_are_malformed():
    payload = copy.deepcopy(SGLANG_EOS)
    payload["meta_info"]["output_token_logprobs"] = [[-0.0123], [-0.4051], [-0.0002]]
    with pytest.raises(MalformedReply, match=r"expected \[logprob, id, text\]"):
        SglangDialect().parse(payload)


@pytest.mark.parametrize("value", [float("nan"), None], ids=["nan", "null"])
def test_sglang_logprobs_that_are_not_numbers_are_malformed(value):
    payload = copy.deepcopy(SGLANG_EOS)
    payload["meta_info"]["output_token_logprobs"][2][0] = value
    with pytest.raises(MalformedReply, match=r"^log-probability .* is not a number$"):
        SglangDialect().parse(payload)


def test_sglang_sampled_request_body():
    assert SglangDialect().body(REQUEST, SAMPLED) == {
        "input_ids": [785, 6722, 315, 9625, 374],
        "sampling_params": {
            "max_new_tokens": 12,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop": ["</a>"],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }


def test_sglang_greedy_request_body_without_stops():
    request = GenerationRequest(prompt=[785, 6722], budget=3, stops=None, seed=5)
    assert SglangDialect(MODEL).body(request, GREEDY) == {
        "input_ids": [785, 6722],
        "sampling_params": {
            "max_new_tokens": 3,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop": [],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }


def test_sglang_top_k_off_and_no_seed():
    request = GenerationRequest(prompt=[785], budget=3, stops=None, seed=None)
    params = SglangDialect().body(request, UNFILTERED)["sampling_params"]
    assert (params["top_k"], params["top_p"], params["temperature"]) == (-1, 0.9, 0.7)
    assert "sampling_seed" not in params


# ---------------------------------------------------------------------------------------------
# llama.cpp /completion

SAMPLED_SETTINGS = {
    "seed": 5, "temperature": 0.699999988079071, "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0, "top_k": 20, "top_p": 0.8999999761581421, "min_p": 0.0,
    "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n", ":", '"', "*"], "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.10000000149011612, "adaptive_target": -1.0,
    "adaptive_decay": 0.8999999761581421, "stop": [], "max_tokens": 6, "n_predict": 6,
    "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False, "logit_bias": [],
    "n_probs": 1, "min_keep": 0, "grammar": "", "grammar_lazy": False, "grammar_triggers": [],
    "preserved_tokens": [], "chat_format": "Content-only", "reasoning_format": "deepseek",
    "reasoning_in_content": False, "generation_prompt": "",
    "samplers": ["top_k", "temperature", "top_p"], "speculative.types": "none",
    "timings_per_token": False, "post_sampling_probs": True, "backend_sampling": False,
    "lora": [],
}  # fmt: skip
GREEDY_SETTINGS = {
    **SAMPLED_SETTINGS, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 3,
    "n_predict": 3, "post_sampling_probs": False,
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature"],
}  # fmt: skip
GGUF = "/root/.cache/envloop/llama.cpp-0.3.36/gguf/policy-b3518509858eb173-f32.gguf"


def entry(token: int, text: str, value: float, *, sampled: bool = True) -> dict[str, Any]:
    """One ``completion_probabilities`` entry: ``prob`` after sampling, else ``logprob``."""
    raw = list(text.encode())
    key, top = ("prob", "top_probs") if sampled else ("logprob", "top_logprobs")
    own = {"id": token, "token": text, "bytes": raw, key: value}
    return {**own, top: [own]}


def llama_answer(
    tokens: list[int], entries: list[dict[str, Any]] | None, stop_type: str, content: str,
    settings: dict[str, Any] = SAMPLED_SETTINGS, stopping_word: str = "",
) -> dict[str, Any]:  # fmt: skip
    """llama-server's ``/completion`` answer (no ``completion_probabilities`` when None)."""
    payload = {
        "index": 0, "content": content, "tokens": tokens, "id_slot": 0, "stop": True,
        "model": GGUF, "tokens_predicted": len(tokens), "tokens_evaluated": 4,
        "generation_settings": settings, "prompt": "<|im_start|><|im_end|>!\"",
        "has_new_line": False, "truncated": False, "stop_type": stop_type,
        "stopping_word": stopping_word, "tokens_cached": 4 + len(tokens) - 1,
        "timings": {
            "cache_n": 0, "prompt_n": 4, "prompt_ms": 0.653, "prompt_per_token_ms": 0.16325,
            "prompt_per_second": 6125.574272588055, "predicted_n": len(tokens),
            "predicted_ms": 0.338, "predicted_per_token_ms": 0.169,
            "predicted_per_second": 5917.159763313609,
        },
    }  # fmt: skip
    if entries is not None:
        payload["completion_probabilities"] = entries
    return payload


# recorded: prompt [1, 2, 3, 4], SAMPLED, budget 6, seed 5
LLAMA_SAMPLED_EOS = llama_answer(
    [19, 95, 2],
    [entry(19, "1", 1.0), entry(95, "}", 0.8463863730430603), entry(2, "", 1.0)],
    "eos", "1}",
)  # fmt: skip
# recorded: prompt [30, 31, 32], GREEDY, budget 3
LLAMA_GREEDY_LIMIT = llama_answer(
    [373, 291, 322],
    [entry(373, "right", -0.031073540449142456, sampled=False),
     entry(291, " 2", -0.12080225348472595, sampled=False),
     entry(322, "up", -0.033574096858501434, sampled=False)],
    "limit", "right 2up", GREEDY_SETTINGS,
)  # fmt: skip
# recorded: prompt [30, 31, 32], GREEDY, budget 12, stop " 2up": the stop string alone is
# three tokens (223, 20, 322), so the server drops three entries, all there were
LLAMA_GREEDY_STOP_WORD = llama_answer(
    [373, 291, 322], None, "word", "right",
    {**GREEDY_SETTINGS, "stop": [" 2up"], "max_tokens": 12, "n_predict": 12},
    stopping_word=" 2up",
)  # fmt: skip


def test_llamacpp_sampled_eos_reads_post_sampling_probabilities():
    reply = LlamaCppDialect().parse(LLAMA_SAMPLED_EOS)
    assert reply == Reply([19, 95, 2], [0.0, math.log(0.8463863730430603), 0.0], "eos", 4)


def test_llamacpp_greedy_length_reads_logprobs():
    """``post_sampling_probs: false`` (greedy) entries carry ``logprob``, not ``prob``."""
    reply = LlamaCppDialect().parse(LLAMA_GREEDY_LIMIT)
    expected = [-0.031073540449142456, -0.12080225348472595, -0.033574096858501434]
    assert reply == Reply([373, 291, 322], expected, "length", 4)


def test_llamacpp_stop_word_that_took_every_entry_leaves_every_position_open():
    reply = LlamaCppDialect().parse(LLAMA_GREEDY_STOP_WORD)
    assert reply == Reply([373, 291, 322], [None, None, None], "stop", 4)


def test_llamacpp_gaps_mid_character_and_after_a_stop_word_are_none_exactly_there():
    """``" costs €.</a>"``: token 158 (byte 0xE2) ends mid-way through "€" and gets no entry
    (the entry of 26022, which completes it, shows the whole character); the stop string
    ``</a>`` alone is three tokens, so the last three entries are dropped."""
    tokens = [3349, 158, 26022, 13, 522, 64, 29]
    entries = [entry(3349, " costs", 0.5), entry(26022, "€", 0.25), entry(13, ".", 0.125)]
    payload = llama_answer(tokens, entries, "word", " costs €.", stopping_word="</a>")
    logprobs = [math.log(0.5), None, math.log(0.25), math.log(0.125), None, None, None]
    assert LlamaCppDialect().parse(payload) == Reply(tokens, logprobs, "stop", 4)
    assert entries[1]["bytes"] == [0xE2, 0x82, 0xAC]


def test_llamacpp_entry_that_could_belong_to_either_repeated_token_is_not_used():
    """``"₂"`` is the bytes E2 82 82; generated as three byte tokens, the first two end
    mid-way through the character and only the third gets an entry. By id alone the entry
    could be the second token's or the third's, so neither takes it: both are scored."""
    e2, x82 = 158, 224  # byte-level tokens of the bytes 0xE2 and 0x82
    payload = llama_answer([e2, x82, x82], [entry(x82, "₂", 0.5)], "eos", "₂")
    assert LlamaCppDialect().parse(payload).logprobs == [None, None, None]
    payload = llama_answer([e2, x82, 5], [entry(x82, "₂", 0.5), entry(5, "x", 1.0)], "eos", "")
    assert LlamaCppDialect().parse(payload).logprobs == [None, math.log(0.5), 0.0]


@pytest.mark.parametrize(
    "ids", [[95, 19, 2], [19, 2, 95], [19, 95, 2, 7]], ids=["swapped", "moved", "extra"]
)
def test_llamacpp_entries_out_of_order_are_malformed(ids):
    payload = copy.deepcopy(LLAMA_SAMPLED_EOS)
    payload["completion_probabilities"] = [entry(t, "", 0.5) for t in ids]
    with pytest.raises(MalformedReply, match="do not follow the order of tokens"):
        LlamaCppDialect().parse(payload)


@pytest.mark.parametrize("prob", [0.0, 1.5, None, "0.5"])
def test_llamacpp_probabilities_outside_0_1_are_malformed(prob):
    payload = copy.deepcopy(LLAMA_SAMPLED_EOS)
    payload["completion_probabilities"][1]["prob"] = prob
    with pytest.raises(MalformedReply, match=r"^probability .* of token 95 is not in \(0, 1\]$"):
        LlamaCppDialect().parse(payload)


def test_llamacpp_without_tokens_is_malformed():
    """A server that ignores ``return_tokens`` (older than the field) gives text only."""
    payload = copy.deepcopy(LLAMA_SAMPLED_EOS)
    del payload["tokens"]
    with pytest.raises(MalformedReply, match="'tokens' missing or not a list"):
        LlamaCppDialect().parse(payload)


def test_llamacpp_unknown_stop_type_is_malformed():
    payload = copy.deepcopy(LLAMA_SAMPLED_EOS)
    payload["stop_type"] = "none"
    with pytest.raises(MalformedReply, match="stop_type 'none'; expected eos, word or limit"):
        LlamaCppDialect().parse(payload)


LLAMA_NEUTRAL = {
    "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
    "top_n_sigma": -1.0, "mirostat": 0,
}  # fmt: skip
"""Every llama.cpp sampler we do not use, switched off (its defaults are not neutral)."""


def test_llamacpp_sampled_request_body():
    assert LlamaCppDialect().body(REQUEST, SAMPLED) == {
        "prompt": [785, 6722, 315, 9625, 374],
        "n_predict": 12,
        **LLAMA_NEUTRAL,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "samplers": ["top_k", "temperature", "top_p"],
        "post_sampling_probs": True,
        "stop": ["</a>"],
        "n_probs": 1,
        "return_tokens": True,
        "cache_prompt": True,
        "stream": False,
        "seed": 5,
    }


def test_llamacpp_greedy_request_body_without_stops():
    request = GenerationRequest(prompt=[785, 6722], budget=3, stops=None, seed=5)
    assert LlamaCppDialect().body(request, GREEDY) == {
        "prompt": [785, 6722],
        "n_predict": 3,
        **LLAMA_NEUTRAL,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "post_sampling_probs": False,
        "stop": [],
        "n_probs": 1,
        "return_tokens": True,
        "cache_prompt": True,
        "stream": False,
        "seed": 5,
    }


@pytest.mark.parametrize(
    ("seed", "sent"), [(None, 0xFFFFFFFF), (0, 0), (2**32 + 7, 7)], ids=["none", "0", "wrap"]
)
def test_llamacpp_seed(seed, sent):
    request = GenerationRequest(prompt=[785], budget=3, stops=None, seed=seed)
    assert LlamaCppDialect().body(request, SAMPLED)["seed"] == sent


def test_llamacpp_top_k_off_is_zero():
    body = LlamaCppDialect().body(REQUEST, UNFILTERED)
    assert (body["top_k"], body["top_p"], body["temperature"]) == (0, 0.9, 0.7)


def test_llamacpp_score_body_for_a_sampled_reply():
    """Scores under the reply's own sampler chain, post-sampling probabilities."""
    assert LlamaCppDialect().score_body(REQUEST, [12095, 13], SAMPLED, 64, attempt=0) == {
        "prompt": [785, 6722, 315, 9625, 374, 12095, 13],
        "n_predict": 1,
        **LLAMA_NEUTRAL,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "samplers": ["top_k", "temperature", "top_p"],
        "post_sampling_probs": True,
        "n_probs": 64,
        "return_tokens": True,
        "cache_prompt": True,
        "stream": False,
        "seed": 5,
    }


def test_llamacpp_score_body_for_a_greedy_reply():
    """Scores the unfiltered distribution: samples at temperature 1 and asks for the
    probabilities before sampling."""
    assert LlamaCppDialect().score_body(REQUEST, [12095], GREEDY, 151936, attempt=2) == {
        "prompt": [785, 6722, 315, 9625, 374, 12095],
        "n_predict": 1,
        **LLAMA_NEUTRAL,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "samplers": ["top_k", "temperature", "top_p"],
        "post_sampling_probs": False,
        "n_probs": 151936,
        "return_tokens": True,
        "cache_prompt": True,
        "stream": False,
        "seed": 2 * 7919 + 5,
    }


def test_llamacpp_score_body_seed_changes_with_the_attempt():
    unseeded = GenerationRequest(prompt=[785], budget=3, stops=None, seed=None)
    seeds = [LlamaCppDialect().score_body(unseeded, [], SAMPLED, 8, n)["seed"] for n in range(3)]
    assert seeds == [0, 7919, 15838]


# recorded: score_body(prompt [30, 31, 32], prefix [19], SAMPLED, n_probs 3, attempt 0)
LLAMA_SCORE_SAMPLED = llama_answer(
    [276],
    [{**entry(276, " -", 0.3831283152103424),
      "top_probs": [{"id": 276, "token": " -", "bytes": [32, 45], "prob": 0.3831283152103424},
                    {"id": 20, "token": "2", "bytes": [50], "prob": 0.3708615005016327},
                    {"id": 95, "token": "}", "bytes": [125], "prob": 0.2460101991891861}]}],
    "limit", " -",
)  # fmt: skip
# recorded: score_body(prompt [30, 31, 32], prefix [373], GREEDY, n_probs 3, attempt 0)
LLAMA_SCORE_GREEDY = llama_answer(
    [291],
    [{**entry(291, " 2", -0.1208023875951767, sampled=False),
      "top_logprobs": [
          {"id": 291, "token": " 2", "bytes": [32, 50], "logprob": -0.1208023875951767},
          {"id": 335, "token": "</", "bytes": [60, 47], "logprob": -3.122687816619873},
          {"id": 303, "token": "left", "bytes": [108, 101, 102, 116],
           "logprob": -4.229381561279297}]}],
    "limit", " 2", GREEDY_SETTINGS,
)  # fmt: skip


def test_llamacpp_parse_score_finds_a_candidate_that_was_not_drawn():
    assert LlamaCppDialect.parse_score(LLAMA_SCORE_SAMPLED, 20) == math.log(0.3708615005016327)
    assert LlamaCppDialect.parse_score(LLAMA_SCORE_GREEDY, 335) == -3.122687816619873


def test_llamacpp_parse_score_without_the_token_is_none():
    assert LlamaCppDialect.parse_score(LLAMA_SCORE_SAMPLED, 19) is None


def test_llamacpp_parse_score_of_a_draw_that_ended_mid_character_is_none():
    payload = llama_answer([158], None, "limit", "")
    assert LlamaCppDialect.parse_score(payload, 158) is None


# ---------------------------------------------------------------------------------------------
# ServerGenerationConfig

URL = "http://127.0.0.1:8000"


def test_config_defaults():
    config = ServerGenerationConfig(base_urls=[URL], tokenizer=MODEL)
    assert config.model_dump() == {
        "base_urls": [URL],
        "dialect": "vllm",
        "tokenizer": MODEL,
        "model": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "seed": 0,
        "max_new_tokens": 512,
        "max_concurrent_requests": 1024,
        "request_timeout_s": 600.0,
        "max_retries": 5,
        "retry_backoff_s": 0.5,
        "startup_timeout_s": 120.0,
    }


def test_config_from_a_mapping():
    options = {"base_urls": [URL], "tokenizer": MODEL, "dialect": "llamacpp", "top_k": 20}
    config = ServerGenerationConfig.from_mapping(options)
    assert config == ServerGenerationConfig(**options)
    assert (config.dialect, config.top_k) == ("llamacpp", 20)


def test_config_mapping_reports_every_problem():
    options = {"base_urls": [], "tokenizer": MODEL, "dialect": "tgi", "max_retires": 2}
    with pytest.raises(ConfigError) as error:
        ServerGenerationConfig.from_mapping(options)
    assert error.value.problems == [
        "base_urls: must have at least 1 item, got []",
        "dialect: 'tgi' is not one of vllm, sglang, llamacpp",
        "max_retires: unknown option. Did you mean 'max_retries'?",
    ]


SGLANG_REFUSAL = (
    "dialect 'sglang' reports log-probabilities with the temperature applied but not "
    "top-k/top-p filtering, so they would not be those of the distribution tokens are drawn "
    "from; set top_k: null and top_p: 1, or serve with vLLM (--logprobs-mode "
    "processed_logprobs) or llama.cpp"
)


@pytest.mark.parametrize("filtering", [{"top_p": 0.9}, {"top_k": 20}], ids=["top_p", "top_k"])
def test_config_refuses_filtered_sampling_on_sglang(filtering):
    options = {"base_urls": [URL], "tokenizer": MODEL, "dialect": "sglang", **filtering}
    with pytest.raises(ConfigError) as error:
        ServerGenerationConfig.from_mapping(options)
    assert error.value.problems == [SGLANG_REFUSAL]


def test_config_accepts_unfiltered_sampling_on_sglang():
    config = ServerGenerationConfig(
        base_urls=[URL], tokenizer=MODEL, dialect="sglang", temperature=0.7
    )
    assert (config.top_p, config.top_k, config.temperature) == (1.0, None, 0.7)
