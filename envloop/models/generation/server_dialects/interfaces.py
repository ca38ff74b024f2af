"""What a dialect is: :class:`ServerDialect`, the requests it writes and the replies it reads.

A dialect owns everything particular to one server's API: the path and body of a generation
request, how its answer is read, what to ask a server at start-up, how to recover
log-probabilities a reply lacks, what the server refuses (images, weight reloads, sampling
settings) and how to fix it, and the requests of a weight reload. The client
(:mod:`~envloop.models.generation.server_client`) and the backend
(:mod:`~envloop.models.generation.server_generation`) only call these hooks; they never ask
which dialect they hold.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from envloop.models.generation.server_media import RequestImages
    from envloop.models.generation.server_routing import ServerSlot

Finish = Literal["eos", "stop", "length"]
"""Why a reply ended: an EOS or stop token, a stop string, or the token budget."""


class MalformedReply(ValueError):
    """A server's answer lacks what the dialect needs (retried like a failed request)."""


class RetryableFailure(Exception):
    """The server could not be reached or gave no usable answer; worth another try."""


class GenerationFailed(Exception):
    """A row's request failed for good; the text says why and where."""


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

    def shifted(self, j: int) -> GenerationRequest:
        """This request with its seed moved on by ``j`` (sample ``j`` of its prompt;
        unseeded stays unseeded; ``j`` 0: the request itself).

        >>> GenerationRequest([5], 4, None, 7).shifted(2).seed
        9
        """
        if j == 0:
            return self
        seed = None if self.seed is None else self.seed + j
        return GenerationRequest(self.prompt, self.budget, self.stops, seed, self.images)


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
    (:meth:`ServerDialect.fill_logprobs` recovers it). ``prompt_tokens`` is the server's
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


Decode = Callable[[list[int]], str]
"""The served model's tokenizer writing token ids as text, special tokens kept."""
GetJson = Callable[[str], Awaitable[Any]]
"""``GET`` a URL's JSON through the client (raises :class:`RetryableFailure` while the
server does not answer)."""
FollowUp = Callable[
    [Callable[["ServerSlot"], dict[str, Any]], Callable[[Any], Any]], Awaitable[Any]
]
"""Send one more request of a row through the client: ``follow_up(body, parse)`` posts
``body(server)`` to the dialect's :attr:`~ServerDialect.path` of the server the router picks
(the row's, while it answers), with the client's retries, and returns ``parse(answer)``;
counted in the backend's ``score_requests``."""


class ServerDialect:
    """A server API: the path and body of a generation request, how to read its answer,
    what to ask a server before generating, how to fill log-probabilities a reply lacks,
    and how a server reloads its weights.

    ``model`` is the served model's name where the API takes one; ``decode`` writes token
    ids as text for a dialect that must send some of a prompt as text.
    """

    name: str
    path: str
    images_refused: str | None = None
    """Why this dialect cannot send images (None: it can)."""
    weights_refused: str | None = None
    """Why this dialect's servers cannot reload weights, and the way out (None: they can)."""
    reload_needs: str = ""
    """What a server needs to take :meth:`weight_reload`'s requests (told when one fails)."""
    image_count_fix: str = ""
    """How to make a server count an image prompt's tokens as the processor does (told when
    it counts them differently)."""
    seeds_listed_prompts: bool = False
    """Whether :meth:`batch_body` gives each listed prompt its own request's seed (True: a
    seeded run may list rows of other prompts; False: the server samples every prompt of
    a list with one seed, so only rows whose seed does not matter are listed)."""

    def __init__(self, model: str | None = None, decode: Decode | None = None) -> None:
        self.model, self.decode = model, decode

    @classmethod
    def sampling_refused(cls, top_k: int | None, top_p: float) -> str | None:
        """Why this dialect's log-probabilities would not match sampling with ``top_k`` and
        ``top_p`` (None: they do); the config refuses such settings."""
        return None

    def body(
        self, request: GenerationRequest, sampling: Sampling, media: ServerMedia | None = None
    ) -> dict[str, Any]:
        """The request body; ``media`` is what the chosen server said about images."""
        raise NotImplementedError

    def parse(self, payload: Any) -> Reply:
        """The reply in a server's answer; raises :class:`MalformedReply` when it lacks
        what the dialect needs."""
        raise NotImplementedError

    def group_body(
        self, request: GenerationRequest, n: int, sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The body of one request for ``n`` completions of ``request`` (a text prompt),
        completion ``j`` sampled with seed ``request.seed + j`` exactly as a request of its
        own with that seed would be. Only called where :meth:`start` set the server's
        ``parallel`` to ``n`` or more (it stays 1 for a dialect that cannot)."""
        raise NotImplementedError(f"the {self.name} dialect sends one completion per request")

    def batch_body(
        self, requests: list[GenerationRequest], sampling: Sampling,
        media: ServerMedia | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The body of one request listing the text prompts of ``requests`` (one budget,
        one set of stop strings), prompt ``j`` answered as a request of its own with the
        first request's seed would be, or with its own seed where
        :attr:`seeds_listed_prompts` (else callers send only rows whose seed does not
        matter). Only called where :meth:`start` set the server's ``parallel`` to
        ``len(requests)`` or more."""
        raise NotImplementedError(f"the {self.name} dialect sends one prompt per request")

    def parse_group(self, payload: Any, n: int) -> list[Reply]:
        """The ``n`` replies in the answer to a :meth:`group_body` or :meth:`batch_body`
        request, completion or prompt ``j`` at index ``j``; raises
        :class:`MalformedReply` when it lacks one."""
        raise NotImplementedError(f"the {self.name} dialect sends one completion per request")

    def probe_body(self, token_id: int) -> dict[str, Any]:
        """A one-token request that shows whether the server gives token ids back."""
        return self.body(GenerationRequest([token_id], 1, None, 0), _PROBE_SAMPLING)

    async def start(self, server: ServerSlot, get_json: GetJson, vision: bool) -> None:
        """Ask ``server`` at start-up, before its probe request, what later requests need
        (``vision``: the served model takes images, into ``server.media``; the completions
        one request may ask for, into ``server.parallel``); nothing by default."""

    def images_refused_by(self, media: ServerMedia | None) -> str | None:
        """Why a server that said ``media`` at start-up cannot take images, and the fix
        (None: it can, or was not asked)."""
        return None

    async def fill_logprobs(
        self, request: GenerationRequest, sampling: Sampling, reply: Reply, follow_up: FollowUp,
        vocab_size: int,
    ) -> list[float]:  # fmt: skip
        """``reply.logprobs`` with every None replaced, asking the server again through
        ``follow_up`` where needed (``vocab_size``: the served model's, the most candidates
        a server can list); the client calls this only for a reply with gaps. Raises
        :class:`GenerationFailed` where the dialect cannot fill them."""
        raise GenerationFailed("the server reported no log-probability for some tokens")

    def weight_reload(self, checkpoint: str, version: int) -> WeightReload:
        """The requests that make one server serve ``checkpoint`` (a path on the server's
        machine) as policy ``version``; raises ``NotImplementedError`` with
        :attr:`weights_refused` where the server cannot."""
        raise NotImplementedError(self.weights_refused)

    def control_failed(self, status: int, text: str) -> bool:
        """Whether the answer (HTTP ``status``, body ``text``) to a weight-update request
        says it failed: any status but 200, or JSON with ``"success": false``."""
        return status != 200 or _declares_failure(text)


_PROBE_SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=None, greedy=True)


def _declares_failure(text: str) -> bool:
    """Whether an answer is JSON saying ``"success": false`` (SGLang's way of failing)."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(payload, dict) and payload.get("success") is False
