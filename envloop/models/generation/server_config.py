"""The settings of the server backend (:class:`ServerGenerationConfig`), declared once and
validated on construction with every problem reported. Imports no torch and no HTTP client:
``envloop run`` checks them before it starts anything, and its ``policy`` section with
``backend: server`` is this config."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from envloop.config.validation import Config, NonEmptyStr
from envloop.models.generation.server_dialects.registry import DIALECTS
from envloop.models.tokenizers import ChatTemplate, ChatTemplateKwargs

Dialect = Literal["vllm", "sglang", "llamacpp"]
"""The names of :data:`~envloop.models.generation.server_dialects.registry.DIALECTS`."""
DEFAULT_DIALECT: Dialect = "vllm"


class ServerGenerationConfig(Config):
    """Settings of :class:`~envloop.models.generation.server_generation.ServerGeneration`.

    >>> config = ServerGenerationConfig(base_urls=["http://127.0.0.1:8000"], tokenizer="Q/Q3")
    >>> config.dialect, config.max_concurrent_requests
    ('vllm', 1024)
    >>> ServerGenerationConfig(base_urls=[], tokenizer="t", dialect="tgi")
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid ServerGenerationConfig:
      - base_urls: must have at least 1 item, got []
      - dialect: 'tgi' is not one of vllm, sglang, llamacpp
    """

    base_urls: Annotated[list[NonEmptyStr], Field(min_length=1)]
    """Server URLs, e.g. ``[http://127.0.0.1:8000]``; several: each request goes to the one
    with the fewest requests outstanding, every turn of a sample to the same one while it
    answers."""
    dialect: Dialect = DEFAULT_DIALECT
    """The servers' API: ``vllm`` (``/v1/completions``), ``sglang`` (``/generate``) or
    ``llamacpp`` (llama-server's ``/completion``)."""
    tokenizer: NonEmptyStr
    """The served model's tokenizer (folder, hub id or ``bundled:<name>``): prompts are
    tokenized and responses decoded with it; token ids cross the wire, never text."""
    chat_template: ChatTemplate  # both declared in envloop.models.tokenizers
    chat_template_kwargs: ChatTemplateKwargs
    model: NonEmptyStr | None = None
    """The served model's name, sent with each vLLM request; None: the first of the server's
    ``/v1/models``. SGLang and llama.cpp ignore it."""
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    """Sampling temperature (for argmax, generate greedily)."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass in (0, 1]; 1 keeps every token."""
    top_k: Annotated[int, Field(ge=1)] | None = None
    """Keep only the k most likely tokens; None: all."""
    seed: Annotated[int, Field(ge=0)] | None = 0
    """Base of each request's sampling seed (request ``n`` of this backend gets a seed
    derived from it and ``n``; a retried request keeps its seed); None: unseeded (llama.cpp
    rows of other prompts may then share a request, as greedy rows always may)."""
    max_new_tokens: Annotated[int, Field(ge=1)] = 512
    """Most tokens generated per sample and turn; a sample's remaining ``max_seq_len`` may
    lower it."""
    max_concurrent_requests: Annotated[int, Field(ge=1)] = 1024
    """Requests in flight at once, over all servers."""
    max_requests_per_server: Annotated[int, Field(ge=1)] | None = None
    """Requests sent to one server at once; the others wait in the client (their
    ``request_timeout_s`` starts when they are sent). None: only
    ``max_concurrent_requests`` bounds them. llama-server starts a thread per open
    connection: give it a few times its ``--parallel`` slots (its throughput does not grow
    past them), not thousands."""
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """Seconds one request may take before it counts as failed (and is retried)."""
    max_retries: Annotated[int, Field(ge=0)] = 5
    """Retries of a request after a refused connection, a 5xx or 429 answer, a timeout or a
    malformed response, with exponential backoff and jitter; then only its sample fails."""
    retry_backoff_s: Annotated[float, Field(gt=0)] = 0.5
    """First retry's mean wait; each further retry doubles it (up to 30 s)."""
    startup_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """Seconds construction waits for a first server to answer the probe request (it
    starts with those that answer; the others join the routing when they answer)."""

    @model_validator(mode="after")
    def _dialect_takes_the_sampling(self) -> ServerGenerationConfig:
        refused = DIALECTS[self.dialect].sampling_refused(self.top_k, self.top_p)
        if refused is not None:
            raise ValueError(refused)
        return self
