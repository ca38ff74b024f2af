"""SGLang's dialect: the native ``/generate`` with ``input_ids`` (:class:`SglangDialect`)."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

from envloop.models.generation.server_dialects.interfaces import (
    ControlRequest,
    Finish,
    GenerationRequest,
    GetJson,
    MalformedReply,
    Reply,
    Sampling,
    ServerDialect,
    ServerMedia,
    WeightReload,
)
from envloop.models.generation.server_dialects.payloads import (
    checked_reply,
    count,
    field,
    listed_answers,
    openai_sampling,
)

if TYPE_CHECKING:
    from envloop.models.generation.server_media import RequestImages
    from envloop.models.generation.server_routing import ServerSlot


class SglangDialect(ServerDialect):
    """SGLang's native ``/generate`` with ``input_ids``.

    >>> reply = SglangDialect().parse({"output_ids": [7, 2], "meta_info": {"finish_reason":
    ...     {"type": "stop", "matched": 2}, "output_token_logprobs": [[-0.1, 7, None],
    ...     [-0.2, 2, None]]}})
    >>> reply.tokens, reply.logprobs, reply.finish
    ([7, 2], [-0.1, -0.2], 'eos')

    Log-probabilities: SGLang applies only the temperature to a sampled token's, so top-k
    and top-p are refused (:meth:`sampling_refused`).

    Images go as ``image_data`` (PNG data URIs) with ``input_ids`` holding each image as
    ``vision_start pad vision_end``: SGLang's multimodal processor expands each pad to the
    image's token count, keeping the other ids as sent when the server runs with
    ``SGLANG_MM_AVOID_RETOKENIZE=1`` (else it decodes and re-tokenizes them).

    Several rows in one request (:meth:`batch_body`, :meth:`group_body`): ``input_ids`` a
    list of prompts and ``sampling_params`` a list of each prompt's own parameters, its
    ``sampling_seed`` included, so each prompt is sampled as a request of its own would be
    (``GenerateReqInput`` takes lists of both; the answer is a list of the prompts'
    answers, in order). At most :data:`ROWS_PER_REQUEST` rows per request, text only.

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
    image_count_fix = "run the SGLang server with SGLANG_MM_AVOID_RETOKENIZE=1"
    seeds_listed_prompts = True

    @classmethod
    def sampling_refused(cls, top_k: int | None, top_p: float) -> str | None:
        """SGLang's log-probabilities leave out top-k and top-p filtering.

        >>> SglangDialect.sampling_refused(None, 1.0) is None
        True
        """
        if top_k is None and top_p >= 1:
            return None
        return (
            "dialect 'sglang' reports log-probabilities with the temperature applied but "
            "not top-k/top-p filtering, so they would not be those of the distribution "
            "tokens are drawn from; set top_k: null and top_p: 1, or serve with vLLM "
            "(--logprobs-mode processed_logprobs) or llama.cpp"
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

    async def start(self, server: ServerSlot, get_json: GetJson, vision: bool) -> None:
        """SGLang takes a list of prompts in one request: up to :data:`ROWS_PER_REQUEST`."""
        server.parallel = ROWS_PER_REQUEST

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": request.prompt,
            "sampling_params": _params(request, sampling),
            "return_logprob": True,
            "logprob_start_len": -1,
            "top_logprobs_num": 0,
            "stream": False,
        }
        if request.images is not None:
            body["input_ids"] = _collapsed(request.prompt, request.images)
            body["image_data"] = [_data_uri(png) for png in request.images.png]
        return body

    def group_body(
        self, request: GenerationRequest, n: int, sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`batch_body` of ``request``'s prompt ``n`` times, with seeds ``seed + j``
        (SGLang's radix cache processes the shared prompt once).

        >>> body = SglangDialect().group_body(GenerationRequest([5, 6], 4, None, 7), 2,
        ...     Sampling(1.0, 1.0, None, greedy=False))
        >>> body["input_ids"], [p["sampling_seed"] for p in body["sampling_params"]]
        ([[5, 6], [5, 6]], [7, 8])
        """
        return self.batch_body([request.shifted(j) for j in range(n)], sampling, media)

    def batch_body(
        self, requests: list[GenerationRequest], sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One request listing ``requests``' prompts, each with its own sampling
        parameters (its seed and budget included)."""
        if any(r.images is not None for r in requests):
            raise ValueError("an SGLang request listing several prompts takes no images")
        return {
            **self.body(requests[0], sampling, media),
            "input_ids": [r.prompt for r in requests],
            "sampling_params": [_params(r, sampling) for r in requests],
        }

    def parse_group(self, payload: Any, n: int) -> list[Reply]:
        """The answer to a request listing ``n`` prompts: their ``n`` answers, in order."""
        return [self.parse(item) for item in listed_answers(payload, n, f"listed {n} prompts")]

    def parse(self, payload: Any) -> Reply:
        meta = field(payload, "meta_info", dict)
        entries = field(meta, "output_token_logprobs", list)
        if not all(isinstance(e, (list, tuple)) and len(e) >= 2 for e in entries):
            raise MalformedReply("meta_info.output_token_logprobs: expected [logprob, id, text]")
        named = [e[1] for e in entries]
        tokens = payload.get("output_ids")
        if tokens is None:
            tokens = named
        if not isinstance(tokens, list) or tokens != named:
            raise MalformedReply("output_ids and meta_info.output_token_logprobs disagree")
        reason = field(meta, "finish_reason", dict)
        kind = reason.get("type")
        if kind not in ("stop", "length"):
            raise MalformedReply(f"finish_reason {reason!r}; expected type 'stop' or 'length'")
        ended: Finish = "length" if kind == "length" else "eos"
        if kind == "stop" and isinstance(reason.get("matched"), str):
            ended = "stop"
        reply = checked_reply(tokens, [e[0] for e in entries], ended)
        reply.prompt_tokens = count(meta.get("prompt_tokens"))
        return reply


ROWS_PER_REQUEST = 16
"""The most rows :class:`SglangDialect` lists in one request: enough to share the HTTP work
(16 rows' requests cost the client about what one does), few enough that a row does not
wait long for the others of its request before its answer comes back."""


def _params(request: GenerationRequest, sampling: Sampling) -> dict[str, Any]:
    """A request's ``sampling_params``: every knob, its budget, and its seed if it has one."""
    params: dict[str, Any] = {
        "max_new_tokens": request.budget,
        **openai_sampling(sampling, top_k_off=-1),
        "stop": request.stops or [],
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if request.seed is not None:
        params["sampling_seed"] = request.seed
    return params


def _collapsed(prompt: list[int], images: RequestImages) -> list[int]:
    """``prompt`` with each image span cut to its first, one pad, and last id.

    >>> from envloop.models.generation.server_media import RequestImages
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
