"""llama.cpp's dialect: its request bodies, and how it reads answers written out here as
llama-server returns them, fields we ignore included. The tokens, probabilities, stop fields
and generation settings of the answers marked "recorded" came from the llama-server that
``scripts/build_llama_server.sh`` builds, serving the bundled policy (their timings and
prompt text are the first one's); the others change one thing in that shape (a gap mid-way
through a character, entries out of order)."""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import pytest

from envloop.models.generation.server_dialects import (
    GenerationFailed,
    GenerationRequest,
    LlamaCppDialect,
    MalformedReply,
    Reply,
    RetryableFailure,
    ServerMedia,
)
from envloop.models.generation.server_routing import ServerSlot
from tests.fixtures.dialect_requests import GREEDY, REQUEST, SAMPLED, UNFILTERED

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


PROPS = {
    "modalities": {"vision": True, "audio": False}, "media_marker": "<__media__>",
    "total_slots": 4,
}  # fmt: skip


def test_llamacpp_start_reads_the_slots_and_the_media_marker_only_for_a_model_with_images():
    asked = []

    async def get_json(url: str) -> Any:
        asked.append(url)
        return PROPS

    text_server, vision_server = ServerSlot("http://a"), ServerSlot("http://b")
    asyncio.run(LlamaCppDialect().start(text_server, get_json, vision=False))
    asyncio.run(LlamaCppDialect().start(vision_server, get_json, vision=True))
    assert asked == ["http://a/props", "http://b/props"]
    assert (text_server.media, text_server.parallel) == (None, 4)
    assert (vision_server.media, vision_server.parallel) == (ServerMedia(True, "<__media__>"), 4)


def test_llamacpp_start_without_props_keeps_one_completion_per_request_for_text_only():
    async def no_props(url: str) -> Any:
        raise RetryableFailure(f"GET {url}: HTTP 404")

    server = ServerSlot("http://a")
    asyncio.run(LlamaCppDialect().start(server, no_props, vision=False))
    assert (server.media, server.parallel) == (None, 1)
    with pytest.raises(RetryableFailure, match="HTTP 404"):
        asyncio.run(LlamaCppDialect().start(ServerSlot("http://b"), no_props, vision=True))


@pytest.mark.parametrize(
    ("props", "slots"), [({"total_slots": 8}, 8), ({}, 1), ({"total_slots": 0}, 1), ([], 1)]
)
def test_llamacpp_parse_slots(props, slots):
    assert LlamaCppDialect.parse_slots(props) == slots


def test_llamacpp_group_body_asks_for_n_completions_of_the_rows_body():
    dialect = LlamaCppDialect()
    body = dialect.group_body(REQUEST, 3, SAMPLED)
    assert body == {**dialect.body(REQUEST, SAMPLED), "n_cmpl": 3}
    assert body["seed"] == REQUEST.seed  # completion j: seed + j, llama-server's child tasks


def test_llamacpp_batch_body_lists_the_rows_prompts_in_the_first_rows_body():
    dialect = LlamaCppDialect()
    other = GenerationRequest([9, 8], REQUEST.budget, REQUEST.stops, None)
    body = dialect.batch_body([REQUEST, other], GREEDY)
    assert body == {**dialect.body(REQUEST, GREEDY), "prompt": [REQUEST.prompt, [9, 8]]}
    longer = GenerationRequest([9, 8], REQUEST.budget + 1, REQUEST.stops, None)
    with pytest.raises(ValueError, match="share a budget and stops"):
        dialect.batch_body([REQUEST, longer], GREEDY)


def test_llamacpp_parse_group_reads_the_answers_in_index_order():
    answers = [
        {**llama_answer([7 + j], [entry(7 + j, "x", 0.5)], "limit", "x"), "index": j}
        for j in range(3)
    ]
    replies = LlamaCppDialect().parse_group(answers, 3)
    assert [(r.tokens, r.logprobs, r.finish) for r in replies] == [
        ([7 + j], [math.log(0.5)], "length") for j in range(3)
    ]
    with pytest.raises(MalformedReply, match="asked for 3 completions, got 2 answers"):
        LlamaCppDialect().parse_group(answers[:2], 3)
    with pytest.raises(MalformedReply, match="asked for 3 completions, got one answer"):
        LlamaCppDialect().parse_group(answers[0], 3)
    with pytest.raises(MalformedReply, match=r"out of order: index \[1, 0, 2\]"):
        LlamaCppDialect().parse_group([answers[1], answers[0], answers[2]], 3)


def test_llamacpp_refuses_images_only_for_a_server_without_a_vision_projector():
    dialect = LlamaCppDialect()
    assert dialect.images_refused_by(None) is None  # not asked: a text-only model
    assert dialect.images_refused_by(ServerMedia(True, "<__media__>")) is None
    refused = dialect.images_refused_by(ServerMedia(False))
    assert refused is not None and refused.startswith("serves no vision projector; start ")


def scoring_server(sent: list[tuple[list[int], int, int]], listed_from: int) -> Any:
    """A follow-up that answers scoring requests for the position after prompt + [19]: the
    drawn token 7 and token 8, and token 95 too when ``n_probs >= listed_from``."""

    async def follow_up(body: Any, parse: Any) -> Any:
        request = body(ServerSlot("http://s"))
        sent.append((request["prompt"], request["n_probs"], request["seed"]))
        top = [{"id": 7, "prob": 0.75}, {"id": 8, "prob": 0.125}]
        if request["n_probs"] >= listed_from:
            top.append({"id": 95, "prob": 0.125})
        return parse({"completion_probabilities": [{"id": 7, "top_probs": top}]})

    return follow_up


GAP_REQUEST = GenerationRequest([30, 31], 4, None, 5)
GAP_REPLY = Reply([19, 95, 2], [-0.1, None, -0.2], "eos")


@pytest.mark.parametrize(
    ("vocab", "listed_from", "n_probs"),
    [(3, 3, [3]), (100, 64, [64]), (100, 100, [64, 100])],
    ids=["small-vocabulary", "among-the-first-64", "whole-vocabulary"],
)
def test_llamacpp_fills_a_gap_from_the_first_64_candidates_then_the_vocabulary(
    vocab, listed_from, n_probs
):
    sent: list[tuple[list[int], int, int]] = []
    follow_up = scoring_server(sent, listed_from)
    fill = LlamaCppDialect().fill_logprobs(GAP_REQUEST, SAMPLED, GAP_REPLY, follow_up, vocab)
    assert asyncio.run(fill) == [-0.1, math.log(0.125), -0.2]
    assert sent == [([30, 31, 19], n, 5) for n in n_probs]


def test_llamacpp_fails_the_row_when_no_scoring_answer_has_the_token():
    sent: list[tuple[list[int], int, int]] = []
    follow_up = scoring_server(sent, listed_from=101)
    fill = LlamaCppDialect().fill_logprobs(GAP_REQUEST, SAMPLED, GAP_REPLY, follow_up, 100)
    with pytest.raises(GenerationFailed, match="no probability for token 95 at position 1 "):
        asyncio.run(fill)
    seeds = [5, 5, 7924, 7924, 15843, 15843]  # each of 3 attempts with its own seed
    assert sent == [([30, 31, 19], n, seed) for n, seed in zip([64, 100] * 3, seeds)]
