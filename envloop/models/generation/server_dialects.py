"""What a request to each kind of inference server looks like, and how its answer is read.

Prompts go out as token ids; the generated token ids and the log-probability of each come
back from the server's own fields, never from re-tokenizing text. Every sampling knob is
sent explicitly, because each server fills a missing one from the model's or its own
defaults (llama.cpp samples with top-k 40, top-p 0.95, min-p 0.05 and temperature 0.8 by
default, vLLM stops at 16 tokens, SGLang at 128).

Log-probabilities, as each dialect asks for them:

- sampled tokens: the log-probability under the distribution the token was drawn from
  (temperature, then top-k and top-p): llama.cpp's post-sampling probabilities with its
  samplers in that order; vLLM's when the server runs with
  ``--logprobs-mode processed_logprobs``; SGLang applies only the temperature, so its
  config refuses top-k and top-p (:class:`ServerGenerationConfig`);
- greedy tokens: the model's unfiltered log-softmax at temperature 1, the value all three
  servers report for an argmax.

Images (a row's :class:`~server_media.RequestImages`) go as each server's source defines:
llama.cpp takes a prompt *string* with its media marker where each image stands and the
images base64-encoded (it cannot mix token ids and images, so the text around the images is
decoded and re-tokenized by the server); SGLang takes ``input_ids`` with one
``<|image_pad|>`` per image and ``image_data``, and expands each pad itself; vLLM's
``/v1/completions`` takes no images (see :class:`VllmDialect`). The server's count of
prompt tokens (``Reply.prompt_tokens``) is then checked against the row's.

Shapes of the answers were read from each server's source (llama.cpp: the version
``scripts/build_llama_server.sh`` builds; vLLM's ``CompletionResponse``; SGLang's
``/generate`` output); ``tests/unit/models/generation/test_server_dialects.py`` holds
recorded examples.

Weight reloads (:meth:`ServerDialect.weight_reload`): the requests that make a vLLM or SGLang
server serve a checkpoint from its disk, read from their sources as each class says
(``tests/unit/models/generation/test_server_weight_updates.py`` replays recorded shapes:
neither server runs on the machines these tests run on). llama.cpp's server cannot reload.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from envloop.models.generation.server_config import Dialect
from envloop.models.generation.server_media import RequestImages

Finish = Literal["eos", "stop", "length"]
"""Why a reply ended: an EOS or stop token, a stop string, or the token budget."""


class MalformedReply(ValueError):
    """A server's answer lacks what the dialect needs (retried like a failed request)."""


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen (the backend's config, or greedy for this call)."""

    temperature: float
    top_p: float
    top_k: int | None
    greedy: bool


@dataclass(frozen=True)
class GenerationRequest:
    """One row to generate for: its prompt token ids, token budget, stop strings, seed and
    images (None for a text-only row)."""

    prompt: list[int]
    budget: int
    stops: list[str] | None
    seed: int | None
    images: RequestImages | None = None


@dataclass(frozen=True)
class ServerMedia:
    """What a server said at start-up about image input: whether it takes images, and the
    marker that stands for one in a llama.cpp prompt string."""

    vision: bool
    marker: str | None = None


@dataclass
class Reply:
    """What a server generated for one request.

    ``logprobs[i]`` is None where the server reported no probability for ``tokens[i]``
    (llama.cpp, see :meth:`LlamaCppDialect.parse`). ``prompt_tokens`` is the server's
    count of the prompt's tokens, images expanded (None where it gives none)."""

    tokens: list[int]
    logprobs: list[float | None]
    finish: Finish
    prompt_tokens: int | None = None


@dataclass(frozen=True)
class ControlRequest:
    """One ``POST`` of a weight update: ``path`` (with its query string) and the JSON
    ``body`` (None: an empty body)."""

    path: str
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class WeightReload:
    """The requests that make one server serve a new checkpoint, in order: ``pause``, then
    ``reload`` (skipped when a pause request failed), then ``resume`` (always, so that no
    server stays paused)."""

    reload: ControlRequest
    pause: tuple[ControlRequest, ...] = ()
    resume: tuple[ControlRequest, ...] = ()


class ServerDialect:
    """A server API: the path and body of a generation request, how to read its answer,
    and how a server reloads its weights."""

    name: Dialect
    path: str
    images_refused: str | None = None
    """Why this dialect cannot send images (None: it can)."""
    weights_refused: str | None = None
    """Why this dialect's servers cannot reload weights, and the way out (None: they can)."""
    reload_needs: str = ""
    """What a server needs to take :meth:`weight_reload`'s requests (told when one fails)."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        """The request body; ``media`` is what the chosen server said about images."""
        raise NotImplementedError

    def parse(self, payload: Any) -> Reply:
        raise NotImplementedError

    def probe_body(self, token_id: int) -> dict[str, Any]:
        """A one-token request that shows whether the server gives token ids back."""
        return self.body(GenerationRequest([token_id], 1, None, 0), _PROBE_SAMPLING)

    def weight_reload(self, checkpoint: str, version: int) -> WeightReload:
        """The requests that make one server serve ``checkpoint`` (a path on the server's
        machine) as policy ``version``; raises ``NotImplementedError`` with
        :attr:`weights_refused` where the server cannot."""
        raise NotImplementedError(self.weights_refused)


_PROBE_SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=None, greedy=True)


class VllmDialect(ServerDialect):
    """vLLM's OpenAI-compatible ``/v1/completions`` with a token-id prompt.

    Token ids come from ``choices[0].token_ids`` (``return_token_ids``, vLLM >= 0.10.2) or,
    on older servers, from ``logprobs.tokens`` written as ``"token_id:<id>"``
    (``return_tokens_as_token_ids``); when both are present they must agree.

    >>> reply = VllmDialect("m").parse({"choices": [{"finish_reason": "stop", "stop_reason":
    ...     "</a>", "logprobs": {"tokens": ["token_id:5", "token_id:9"],
    ...     "token_logprobs": [-0.5, -1.0]}}]})
    >>> reply.tokens, reply.logprobs, reply.finish
    ([5, 9], [-0.5, -1.0], 'stop')

    Images: ``/v1/completions`` has no multimodal input. vLLM's token-in endpoint
    ``/inference/v1/generate`` takes ``token_ids`` with ``features`` (each image's hash,
    placeholder offset and length, and its processed tensors serialized by vLLM's own
    ``mm_serde``), which only its ``/v1/chat/completions/render`` produces; not done yet.

    Weight reload (:meth:`weight_reload`), three requests:

    1. ``POST /pause?mode=wait``: the engine queues new requests, lets the running ones
       finish, then clears its prefix cache (``clear_cache`` defaults to true); answers
       ``{"status": "paused"}``.
    2. ``POST /collective_rpc`` with ``{"method": "reload_weights", "kwargs":
       {"weights_path": <checkpoint>}}``: every worker reads the checkpoint in place with
       the model loader the server started with; answers ``{"results": [null, ...]}``, one
       entry per worker (HTTP 500 when a worker raised).
    3. ``POST /resume``: answers ``{"status": "resumed"}``.

    Read from vllm-project/vllm: ``/pause`` and ``/resume`` in
    ``vllm/entrypoints/serve/rlhf/api_router.py`` (``vllm/entrypoints/rl/online/api_router.py``
    in the newest sources), ``/collective_rpc`` in ``vllm/entrypoints/serve/rpc/api_router.py``,
    both mounted only when the server runs with ``VLLM_SERVER_DEV_MODE=1``;
    ``GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None,
    is_checkpoint_format=True)`` in ``vllm/v1/worker/gpu_model_runner.py``, reached through
    ``Worker.reload_weights`` in ``vllm/v1/worker/gpu_worker.py``; what ``mode=wait`` does in
    ``EngineCore.pause_scheduler`` (``vllm/v1/engine/core.py``). A vLLM older than the
    ``mode`` parameter ignores it and aborts the running requests instead (ServerGeneration's
    own requests are answered before it pauses, so only other clients' are affected).
    """

    name = "vllm"
    path = "/v1/completions"
    images_refused = (
        "vLLM's /v1/completions takes no images with a token-id prompt (its "
        "/inference/v1/generate needs features rendered by /v1/chat/completions/render, "
        "which envloop does not do yet); serve the model with llama.cpp (--mmproj) or SGLang"
    )
    reload_needs = (
        "vLLM serves /pause, /resume and /collective_rpc only when started with "
        "VLLM_SERVER_DEV_MODE=1, and its workers' reload_weights must take weights_path "
        "(a recent vLLM); the checkpoint must be a folder the server can read, with the "
        "served model's architecture"
    )

    def weight_reload(self, checkpoint: str, version: int) -> WeightReload:
        """Pause (draining), reload from ``checkpoint``, resume; vLLM keeps no version label.

        >>> reload = VllmDialect().weight_reload("/ckpt/step-2", 2)
        >>> [r.path for r in (*reload.pause, reload.reload, *reload.resume)]
        ['/pause?mode=wait', '/collective_rpc', '/resume']
        >>> reload.reload.body
        {'method': 'reload_weights', 'kwargs': {'weights_path': '/ckpt/step-2'}}
        """
        return WeightReload(
            pause=(ControlRequest("/pause?mode=wait"),),
            reload=ControlRequest(
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}},
            ),
            resume=(ControlRequest("/resume"),),
        )

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": request.prompt,
            "max_tokens": request.budget,
            **_openai_sampling(sampling, top_k_off=-1),
            "stop": request.stops or [],
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": False,
        }
        if request.seed is not None:
            body["seed"] = request.seed
        if self.model is not None:
            body["model"] = self.model
        return body

    def parse(self, payload: Any) -> Reply:
        choice = _first(_field(payload, "choices", list), "choices")
        logprobs = _field(choice, "logprobs", dict)
        values = _field(logprobs, "token_logprobs", list)
        named = [_token_id_placeholder(t) for t in _field(logprobs, "tokens", list)]
        tokens = choice.get("token_ids")
        if tokens is None:
            tokens = named
        elif list(tokens) != named:
            raise MalformedReply("choices[0].token_ids and logprobs.tokens disagree")
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise MalformedReply(f"finish_reason {finish!r}; expected 'stop' or 'length'")
        ended: Finish = "length" if finish == "length" else "eos"
        if finish == "stop" and isinstance(choice.get("stop_reason"), str):
            ended = "stop"
        reply = _reply(tokens, values, ended)
        usage = payload.get("usage")
        reply.prompt_tokens = (
            _count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
        )
        return reply


class SglangDialect(ServerDialect):
    """SGLang's native ``/generate`` with ``input_ids``.

    >>> reply = SglangDialect().parse({"output_ids": [7, 2], "meta_info": {"finish_reason":
    ...     {"type": "stop", "matched": 2}, "output_token_logprobs": [[-0.1, 7, None],
    ...     [-0.2, 2, None]]}})
    >>> reply.tokens, reply.logprobs, reply.finish
    ([7, 2], [-0.1, -0.2], 'eos')

    Images go as ``image_data`` (PNG data URIs) with ``input_ids`` holding each image as
    ``vision_start pad vision_end``: SGLang's multimodal processor expands each pad to the
    image's token count, keeping the other ids as sent when the server runs with
    ``SGLANG_MM_AVOID_RETOKENIZE=1`` (else it decodes and re-tokenizes them).

    Weight reload (:meth:`weight_reload`), one request: ``POST /update_weights_from_disk``
    with ``{"model_path": <checkpoint>, "abort_all_requests": false, "weight_version":
    "<version>"}``; answers ``{"success": true, "message": "Succeeded to update model
    weights. ...", "num_paused_requests": 0}``, or HTTP 400 with ``"success": false`` and the
    reason (the old weights stay, or are loaded back). The server is not paused: unpaused, SGLang's
    tokenizer manager reloads under its model-update writer lock, which waits for the
    generate requests running to finish and holds new ones until the reload is done, and
    the cache is flushed after it. (``/pause_generation`` would abort the running requests,
    or with ``retract`` and ``in_place`` let them go on after the reload, their tokens then
    coming from two versions.) Read from sgl-project/sglang:
    ``python/sglang/srt/entrypoints/http_server.py`` (the route and its answer),
    ``python/sglang/srt/managers/io_struct.py`` (``UpdateWeightFromDiskReqInput``),
    ``python/sglang/srt/managers/tokenizer_manager.py`` (``update_weights_from_disk`` and
    its lock) and ``docs/advanced_features/sglang_for_rl.md``.
    """

    name = "sglang"
    path = "/generate"
    reload_needs = (
        "SGLang reads model_path on the server's machine: a model folder with the served "
        "model's architecture and sizes"
    )

    def weight_reload(self, checkpoint: str, version: int) -> WeightReload:
        """Reload from ``checkpoint`` (SGLang drains and holds requests around it itself),
        labelled ``version`` on the server.

        >>> reload = SglangDialect().weight_reload("/ckpt/step-2", 2)
        >>> reload.pause, reload.reload.path, reload.resume
        ((), '/update_weights_from_disk', ())
        >>> reload.reload.body
        {'model_path': '/ckpt/step-2', 'abort_all_requests': False, 'weight_version': '2'}
        """
        body = {"model_path": checkpoint, "abort_all_requests": False,
                "weight_version": str(version)}  # fmt: skip
        return WeightReload(reload=ControlRequest("/update_weights_from_disk", body))

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": request.budget,
            **_openai_sampling(sampling, top_k_off=-1),
            "stop": request.stops or [],
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if request.seed is not None:
            params["sampling_seed"] = request.seed
        body: dict[str, Any] = {
            "input_ids": request.prompt,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "stream": False,
        }
        if request.images is not None:
            body["input_ids"] = _collapsed(request.prompt, request.images)
            body["image_data"] = [_data_uri(png) for png in request.images.png]
        return body

    def parse(self, payload: Any) -> Reply:
        meta = _field(payload, "meta_info", dict)
        entries = _field(meta, "output_token_logprobs", list)
        if not all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in entries):
            raise MalformedReply("meta_info.output_token_logprobs: expected [logprob, id, text]")
        named = [e[1] for e in entries]
        tokens = payload.get("output_ids")
        if tokens is None:
            tokens = named
        if not isinstance(tokens, list) or tokens != named:
            raise MalformedReply("output_ids and meta_info.output_token_logprobs disagree")
        reason = _field(meta, "finish_reason", dict)
        kind = reason.get("type")
        if kind not in ("stop", "length"):
            raise MalformedReply(f"finish_reason {reason!r}; expected type 'stop' or 'length'")
        ended: Finish = "length" if kind == "length" else "eos"
        if kind == "stop" and isinstance(reason.get("matched"), str):
            ended = "stop"
        reply = _reply(tokens, [e[0] for e in entries], ended)
        reply.prompt_tokens = _count(meta.get("prompt_tokens"))
        return reply


class LlamaCppDialect(ServerDialect):
    """llama.cpp's ``llama-server`` ``/completion`` with a token-id prompt.

    ``tokens`` holds every generated id (``return_tokens``), an ending EOS and the tokens
    of a stop string included. ``completion_probabilities`` is not one to one with them:
    the server keeps no entry for a token that ends in the middle of a UTF-8 character,
    and after a stop string it drops as many trailing entries as the stop string has
    tokens. Entries are matched to tokens by id; an entry that could belong to either of
    two equal tokens is not used, and a token without an entry gets None, which
    :meth:`score_body` recovers.

    >>> reply = LlamaCppDialect().parse({"tokens": [4, 5, 6], "stop_type": "word",
    ...     "completion_probabilities": [{"id": 4, "prob": 0.5}, {"id": 5, "prob": 1.0}]})
    >>> reply.tokens, reply.logprobs, reply.finish
    ([4, 5, 6], [-0.6931471805599453, 0.0, None], 'stop')

    A prompt with images goes as ``{"prompt_string", "multimodal_data"}``: the server takes
    no token ids beside images, so the text between images is decoded (``decode``, set by
    the backend) and the server's media marker (from ``GET /props``, random per server
    process) stands for each ``vision_start .. vision_end`` span; the server tokenizes the
    text again and puts ``vision_start``, the image's embeddings and ``vision_end`` at each
    marker.
    """

    name = "llamacpp"
    path = "/completion"
    media_path = "/props"
    weights_refused = (
        "llama.cpp's server cannot reload weights; restart llama-server with the new GGUF "
        "(-m <file>; scripts/convert_to_gguf.py converts a checkpoint folder to one) and "
        "build a new ServerGeneration for it"
    )
    decode: Callable[[list[int]], str] | None = None

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        body = {
            "prompt": self._prompt(request, [], media),
            "n_predict": request.budget,
            **self._sampling(sampling),
            "stop": request.stops or [],
            "n_probs": 1,
            "return_tokens": True,
            "cache_prompt": True,
            "stream": False,
        }
        body["seed"] = _LLAMA_RANDOM_SEED if request.seed is None else request.seed % 2**32
        return body

    def score_body(
        self, request: GenerationRequest, prefix: list[int], sampling: Sampling, n_probs: int,
        attempt: int, media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """A one-token request after ``prompt + prefix`` whose answer lists the probability
        of up to ``n_probs`` candidates for that position, under the distribution the
        reply's token there was drawn from (for greedy replies, the unfiltered one). The
        token this request itself draws does not matter, except that one ending mid-way
        through a character gets no entry: ``attempt`` changes the seed for another try."""
        scoring = sampling
        if sampling.greedy:  # raw probabilities do not depend on the sampler; sample at T=1
            scoring = Sampling(1.0, 1.0, None, greedy=False)
        body = {
            "prompt": self._prompt(request, prefix, media),
            "n_predict": 1,
            **self._sampling(scoring),
            "post_sampling_probs": not sampling.greedy,
            "n_probs": n_probs,
            "return_tokens": True,
            "cache_prompt": True,
            "stream": False,
            "seed": (attempt * 7919 + (request.seed or 0)) % 2**32,
        }
        return body

    @staticmethod
    def parse_score(payload: Any, token: int) -> float | None:
        """The log-probability of ``token`` in a :meth:`score_body` answer; None when the
        answer has no entry for its position or ``token`` is not among the candidates."""
        entries = payload.get("completion_probabilities") if isinstance(payload, dict) else None
        if not entries:
            return None
        for candidate in entries[0].get("top_probs") or entries[0].get("top_logprobs") or []:
            if candidate.get("id") == token:
                return _entry_logprob(candidate)
        return None

    def parse(self, payload: Any) -> Reply:
        tokens = _field(payload, "tokens", list)
        entries = payload.get("completion_probabilities") or []
        ids = [entry.get("id") if isinstance(entry, dict) else None for entry in entries]
        earliest, latest = _match_left(tokens, ids), _match_right(tokens, ids)
        if earliest is None or latest is None:
            raise MalformedReply("completion_probabilities do not follow the order of tokens")
        logprobs: list[float | None] = [None] * len(tokens)
        for entry, first, last in zip(entries, earliest, latest):
            if first == last:  # else the entry could belong to more than one repeated token
                logprobs[first] = _entry_logprob(entry)
        stop_type = payload.get("stop_type")
        finish = _LLAMA_FINISH.get(stop_type)
        if finish is None:
            raise MalformedReply(f"stop_type {stop_type!r}; expected eos, word or limit")
        return Reply(list(tokens), logprobs, finish, _count(payload.get("tokens_evaluated")))

    @staticmethod
    def parse_media(payload: Any) -> ServerMedia:
        """What ``GET /props`` says about images: ``modalities.vision`` and ``media_marker``."""
        modalities = payload.get("modalities") if isinstance(payload, dict) else None
        vision = isinstance(modalities, dict) and modalities.get("vision") is True
        marker = payload.get("media_marker") if isinstance(payload, dict) else None
        if vision and not (isinstance(marker, str) and marker):
            raise MalformedReply("/props lists vision but no media_marker")
        return ServerMedia(vision, marker if vision else None)

    def _prompt(
        self, request: GenerationRequest, prefix: list[int], media: ServerMedia | None
    ) -> list[int] | dict[str, Any]:
        """Token ids, or for a row with images the prompt string with a marker per image."""
        images = request.images
        if images is None:
            return request.prompt + prefix
        if media is None or media.marker is None or self.decode is None:
            raise ValueError("a llama.cpp prompt with images needs the server's media marker")
        texts, last = [], 0
        for start, end in images.spans:
            texts.append(self.decode(request.prompt[last:start]))
            last = end
        texts.append(self.decode(request.prompt[last:] + prefix))
        return {
            "prompt_string": media.marker.join(texts),
            "multimodal_data": [base64.b64encode(png).decode("ascii") for png in images.png],
        }

    @staticmethod
    def _sampling(sampling: Sampling) -> dict[str, Any]:
        neutral = {
            "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "top_n_sigma": -1.0, "mirostat": 0,
        }  # fmt: skip
        if sampling.greedy:
            return {**neutral, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                    "post_sampling_probs": False}  # fmt: skip
        return {
            **neutral,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k or 0,
            "top_p": sampling.top_p,
            # top-k is the same before or after the temperature; top-p is not: HF's order
            "samplers": ["top_k", "temperature", "top_p"],
            "post_sampling_probs": True,
        }


_LLAMA_RANDOM_SEED = 0xFFFFFFFF
_LLAMA_FINISH: dict[Any, Finish] = {"eos": "eos", "word": "stop", "limit": "length"}

DIALECTS: dict[str, type[ServerDialect]] = {
    "vllm": VllmDialect,
    "sglang": SglangDialect,
    "llamacpp": LlamaCppDialect,
}


def make_dialect(name: Dialect, model: str | None = None) -> ServerDialect:
    return DIALECTS[name](model)


def _openai_sampling(sampling: Sampling, top_k_off: int) -> dict[str, Any]:
    neutral = {
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    if sampling.greedy:
        return {**neutral, "temperature": 0.0, "top_p": 1.0, "top_k": top_k_off}
    return {
        **neutral,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k is not None else top_k_off,
    }


def _collapsed(prompt: list[int], images: RequestImages) -> list[int]:
    """``prompt`` with each image span cut to its first, one pad, and last id.

    >>> _collapsed([7, 1, 2, 2, 3, 8], RequestImages((b"",), ((1, 5),)))
    [7, 1, 2, 3, 8]
    """
    ids, last = [], 0
    for start, end in images.spans:
        ids += [*prompt[last:start], prompt[start], prompt[start + 1], prompt[end - 1]]
        last = end
    return ids + prompt[last:]


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _reply(tokens: Any, logprobs: list[Any], finish: Finish) -> Reply:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise MalformedReply("token ids must be integers")
    if len(logprobs) != len(tokens):
        raise MalformedReply(f"{len(tokens)} token ids but {len(logprobs)} log-probabilities")
    values = []
    for value in logprobs:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise MalformedReply(f"log-probability {value!r} is not a number")
        values.append(float(value))
    return Reply(list(tokens), list(values), finish)


def _match_left(tokens: list[Any], ids: list[Any]) -> list[int] | None:
    """The earliest position of ``tokens`` each of ``ids`` (a subsequence) can take, in
    order; None when they are not a subsequence."""
    positions, p = [], 0
    for token_id in ids:
        while p < len(tokens) and tokens[p] != token_id:
            p += 1
        if p == len(tokens):
            return None
        positions.append(p)
        p += 1
    return positions


def _match_right(tokens: list[Any], ids: list[Any]) -> list[int] | None:
    """The latest position each of ``ids`` can take (see :func:`_match_left`)."""
    reversed_positions = _match_left(tokens[::-1], ids[::-1])
    if reversed_positions is None:
        return None
    return [len(tokens) - 1 - p for p in reversed_positions[::-1]]


def _entry_logprob(entry: dict[str, Any]) -> float:
    if "logprob" in entry:
        return float(entry["logprob"])
    prob = entry.get("prob")
    if not isinstance(prob, (int, float)) or not 0 < prob <= 1:
        raise MalformedReply(f"probability {prob!r} of token {entry.get('id')} is not in (0, 1]")
    return math.log(prob)


def _token_id_placeholder(text: Any) -> int:
    if not isinstance(text, str) or not text.startswith("token_id:"):
        raise MalformedReply(
            f"logprobs.tokens holds {text!r}, not 'token_id:<id>': the server ignored "
            "return_tokens_as_token_ids (vLLM >= 0.5.0 honours it)"
        )
    try:
        return int(text.removeprefix("token_id:"))
    except ValueError:
        raise MalformedReply(f"logprobs.tokens holds {text!r}, not 'token_id:<id>'") from None


def _field(payload: Any, key: str, kind: type) -> Any:
    value = payload.get(key) if isinstance(payload, dict) else None
    if not isinstance(value, kind):
        raise MalformedReply(f"{key!r} missing or not a {kind.__name__}")
    return value


def _first(items: list[Any], key: str) -> Any:
    if not items:
        raise MalformedReply(f"{key!r} is empty")
    return items[0]
