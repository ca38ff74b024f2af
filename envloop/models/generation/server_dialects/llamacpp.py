"""llama.cpp's dialect: ``llama-server``'s ``/completion`` with a token-id prompt
(:class:`LlamaCppDialect`), and the scoring requests that recover the log-probabilities its
answers leave out."""

from __future__ import annotations

import asyncio
import base64
import functools
import math
from typing import TYPE_CHECKING, Any

from envloop.models.generation.server_dialects.interfaces import (
    Finish,
    FollowUp,
    GenerationFailed,
    GenerationRequest,
    GetJson,
    MalformedReply,
    Reply,
    RetryableFailure,
    Sampling,
    ServerDialect,
    ServerMedia,
)
from envloop.models.generation.server_dialects.payloads import count, field, listed_answers

if TYPE_CHECKING:
    from envloop.models.generation.server_routing import ServerSlot

SCORE_CANDIDATES = 64
"""Candidates a scoring request lists first (then the whole vocabulary)."""
SCORE_ATTEMPTS = 3
"""Scoring tries of one position (each with another seed) before its row fails."""


class LlamaCppDialect(ServerDialect):
    """llama.cpp's ``llama-server`` ``/completion`` with a token-id prompt.

    ``tokens`` holds every generated id (``return_tokens``), an ending EOS and the tokens
    of a stop string included. ``completion_probabilities`` is not one to one with them:
    the server keeps no entry for a token that ends in the middle of a UTF-8 character,
    and after a stop string it drops as many trailing entries as the stop string has
    tokens. Entries are matched to tokens by id; an entry that could belong to either of
    two equal tokens is not used, and a token without an entry gets None, which
    :meth:`fill_logprobs` recovers with :meth:`score_body` requests.

    >>> reply = LlamaCppDialect().parse({"tokens": [4, 5, 6], "stop_type": "word",
    ...     "completion_probabilities": [{"id": 4, "prob": 0.5}, {"id": 5, "prob": 1.0}]})
    >>> reply.tokens, reply.logprobs, reply.finish
    ([4, 5, 6], [-0.6931471805599453, 0.0, None], 'stop')

    Log-probabilities of sampled tokens are llama.cpp's post-sampling probabilities, with
    its samplers in the order top-k, temperature, top-p.

    A prompt with images goes as ``{"prompt_string", "multimodal_data"}``: the server takes
    no token ids beside images, so the text between images is written with ``decode`` (the
    served model's tokenizer, given at construction) and the server's media marker (from
    ``GET /props`` at :meth:`start`, random per server process) stands for each
    ``vision_start .. vision_end`` span; the server tokenizes the text again and puts
    ``vision_start``, the image's embeddings and ``vision_end`` at each marker.
    """

    name = "llamacpp"
    path = "/completion"
    media_path = "/props"
    weights_refused = (
        "llama.cpp's server cannot reload weights; restart llama-server with the new GGUF "
        "(-m <file>; scripts/convert_to_gguf.py converts a checkpoint folder to one) and "
        "build a new ServerGeneration for it"
    )
    image_count_fix = (
        "start llama-server with --image-min-tokens/--image-max-tokens covering the "
        "processor's min_pixels and max_pixels"
    )

    async def start(self, server: ServerSlot, get_json: GetJson, vision: bool) -> None:
        """What ``server`` says in ``GET /props``: its slots (``total_slots``) into
        ``server.parallel``, and for a model that takes images what it says of image input
        into ``server.media``. A text model's server without ``/props`` keeps one
        completion per request."""
        try:
            props = await get_json(server.url + self.media_path)
        except RetryableFailure:
            if vision:
                raise
            return  # not up yet (its probe fails too and start-up asks again), or no /props
        server.parallel = self.parse_slots(props)
        if vision:
            server.media = self.parse_media(props)

    def images_refused_by(self, media: ServerMedia | None) -> str | None:
        if media is None or media.vision:
            return None
        return (
            "serves no vision projector; start llama-server with --mmproj <the model's "
            "mmproj GGUF> (scripts/convert_to_gguf.py --mmproj writes one)"
        )

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

    def group_body(
        self, request: GenerationRequest, n: int, sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`body` with ``n_cmpl`` = ``n``: llama-server processes the prompt once
        and samples completion ``j`` in a slot of its own with seed ``seed + j`` (its child
        tasks); ``n`` must not exceed its slots (``--parallel``)."""
        if request.images is not None:
            raise ValueError("a llama.cpp request for several completions takes no images")
        return {**self.body(request, sampling, media), "n_cmpl": n}

    def batch_body(
        self, requests: list[GenerationRequest], sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """:meth:`body` of the first request with ``prompt`` the list of every request's
        token ids: llama-server answers each prompt in a slot of its own, all with the
        body's one seed (a random one per prompt when unseeded)."""
        first = requests[0]
        if any(r.images is not None for r in requests):
            raise ValueError("a llama.cpp request listing several prompts takes no images")
        if any(r.budget != first.budget or r.stops != first.stops for r in requests):
            raise ValueError("the prompts of one llama.cpp request share a budget and stops")
        return {**self.body(first, sampling, media), "prompt": [r.prompt for r in requests]}

    def parse_group(self, payload: Any, n: int) -> list[Reply]:
        """The answer to :meth:`group_body` or :meth:`batch_body` is a list of ``n``
        answers, ordered by their ``index`` (completion j: seed + j; prompt j)."""
        payload = listed_answers(payload, n, f"asked for {n} completions")
        indexes = [item.get("index", j) if isinstance(item, dict) else j
                   for j, item in enumerate(payload)]  # fmt: skip
        if indexes != list(range(n)):
            raise MalformedReply(f"completions out of order: index {indexes}")
        return [self.parse(item) for item in payload]

    @staticmethod
    def parse_slots(payload: Any) -> int:
        """The slots ``GET /props`` lists (``total_slots``); 1 when it lists none."""
        slots = count(payload.get("total_slots")) if isinstance(payload, dict) else None
        return slots if slots is not None and slots > 0 else 1

    def parse(self, payload: Any) -> Reply:
        tokens = field(payload, "tokens", list)
        entries = payload.get("completion_probabilities") or []
        ids = [entry.get("id") if isinstance(entry, dict) else None for entry in entries]
        logprobs: list[float | None]
        if ids == tokens and None not in ids:  # one entry per token, each its own token's
            logprobs = [_entry_logprob(entry) for entry in entries]
        else:
            earliest, latest = _match_left(tokens, ids), _match_right(tokens, ids)
            if earliest is None or latest is None:
                raise MalformedReply("completion_probabilities do not follow the order of tokens")
            logprobs = [None] * len(tokens)
            for entry, first, last in zip(entries, earliest, latest):
                if first == last:  # else the entry could belong to several repeated tokens
                    logprobs[first] = _entry_logprob(entry)
        stop_type = payload.get("stop_type")
        finish = _LLAMA_FINISH.get(stop_type)
        if finish is None:
            raise MalformedReply(f"stop_type {stop_type!r}; expected eos, word or limit")
        return Reply(list(tokens), logprobs, finish, count(payload.get("tokens_evaluated")))

    async def fill_logprobs(
        self, request: GenerationRequest, sampling: Sampling, reply: Reply, follow_up: FollowUp,
        vocab_size: int,
    ) -> list[float]:  # fmt: skip
        """Each missing log-probability from a scoring request for its position, all sent
        at once (one round trip, not one per gap)."""
        missing = [i for i, value in enumerate(reply.logprobs) if value is None]
        prefixes = [reply.tokens[:i] for i in missing]
        scores = await asyncio.gather(
            *(self._score(request, p, reply.tokens[len(p)], sampling, follow_up, vocab_size)
              for p in prefixes)
        )  # fmt: skip
        filled = list(reply.logprobs)
        for i, value in zip(missing, scores):
            filled[i] = value
        return filled  # type: ignore[return-value]

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

    @staticmethod
    def parse_media(payload: Any) -> ServerMedia:
        """What ``GET /props`` says about images: ``modalities.vision`` and ``media_marker``."""
        modalities = payload.get("modalities") if isinstance(payload, dict) else None
        vision = isinstance(modalities, dict) and modalities.get("vision") is True
        marker = payload.get("media_marker") if isinstance(payload, dict) else None
        if vision and not (isinstance(marker, str) and marker):
            raise MalformedReply("/props lists vision but no media_marker")
        return ServerMedia(vision, marker if vision else None)

    async def _score(
        self, request: GenerationRequest, prefix: list[int], token: int, sampling: Sampling,
        follow_up: FollowUp, vocab_size: int,
    ) -> float:  # fmt: skip
        """The log-probability of ``token`` after ``prompt + prefix``: scoring requests
        listing the first candidates, then the whole vocabulary, each tried with
        :data:`SCORE_ATTEMPTS` seeds."""
        for attempt in range(SCORE_ATTEMPTS):
            for n_probs in dict.fromkeys((min(SCORE_CANDIDATES, vocab_size), vocab_size)):
                body = functools.partial(
                    self._server_score_body, request, prefix, sampling, n_probs, attempt
                )
                value = await follow_up(body, lambda p: _scored(p, token, request, len(prefix)))
                if value is not None:
                    return float(value)
        raise GenerationFailed(
            f"llama.cpp reported no probability for token {token} at position {len(prefix)} "
            f"of the reply, nor in {SCORE_ATTEMPTS} scoring requests"
        )

    def _server_score_body(
        self, request: GenerationRequest, prefix: list[int], sampling: Sampling, n_probs: int,
        attempt: int, server: ServerSlot,
    ) -> dict[str, Any]:  # fmt: skip
        return self.score_body(request, prefix, sampling, n_probs, attempt, server.media)

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


def _scored(payload: Any, token: int, request: GenerationRequest, prefix: int) -> float | None:
    """The score of ``token`` in a scoring answer; for a prompt with images, whose text the
    server re-tokenizes, only when it read the prompt and the reply's first ``prefix``
    tokens as that many tokens."""
    evaluated = payload.get("tokens_evaluated") if isinstance(payload, dict) else None
    expected = len(request.prompt) + prefix
    if request.images is not None and evaluated != expected:
        raise GenerationFailed(
            f"llama.cpp reported no probability for token {token} at position {prefix} of "
            "the reply (it ends mid-way through a character, or in a stop string), and a "
            "prompt with images reaches it only as text: the reply's tokens before it read "
            f"back as {evaluated} tokens, not {expected}; serve the model with SGLang, or use "
            "stop strings and a model whose replies decode to whole characters"
        )
    return LlamaCppDialect.parse_score(payload, token)


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
    if prob.__class__ is float and 0 < prob <= 1:  # the usual case, checked first
        return math.log(prob)
    if not isinstance(prob, (int, float)) or not 0 < prob <= 1:
        raise MalformedReply(f"probability {prob!r} of token {entry.get('id')} is not in (0, 1]")
    return math.log(prob)
