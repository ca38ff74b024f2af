"""vLLM's dialect: ``/v1/completions`` with a token-id prompt (:class:`VllmDialect`)."""

from __future__ import annotations

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
    first,
    openai_sampling,
)

if TYPE_CHECKING:
    from envloop.models.generation.server_routing import ServerSlot


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

    Each request names the served model (``model``); without one, :meth:`start` asks the
    first server to answer ``GET /v1/models`` for it.

    Log-probabilities: a sampled token's is under the distribution it was drawn from when
    the server runs with ``--logprobs-mode processed_logprobs`` (its default,
    ``raw_logprobs``, reports the unfiltered temperature-1 values).

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

    async def start(self, server: ServerSlot, get_json: GetJson, vision: bool) -> None:
        """Without a ``model``, take the first model ``server``'s ``/v1/models`` lists."""
        if self.model is None:
            self.model = _first_model(await get_json(server.url + "/v1/models"), server.url)

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
            **openai_sampling(sampling, top_k_off=-1),
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
        choice = first(field(payload, "choices", list), "choices")
        logprobs = field(choice, "logprobs", dict)
        values = field(logprobs, "token_logprobs", list)
        named = [_token_id_placeholder(t) for t in field(logprobs, "tokens", list)]
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
        reply = checked_reply(tokens, values, ended)
        usage = payload.get("usage")
        reply.prompt_tokens = count(usage.get("prompt_tokens")) if isinstance(usage, dict) else None
        return reply


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


def _first_model(listing: Any, url: str) -> str:
    try:
        return str(listing["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(
            f"{url}/v1/models lists no model; set model to the served model's name"
        ) from None
