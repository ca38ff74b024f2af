"""``ServerGeneration``: generation from inference servers (vLLM, SGLang, llama.cpp), token in
and token out over HTTP.

Each row's prompt goes to a server as token ids, and the generated token ids and their
log-probabilities are read from the server's answer (:mod:`server_dialects`), so the tokens a
trainer sees are exactly the sampled ones: text is never re-tokenized between turns. On
construction the servers get a probe request (:mod:`server_fleet`): the backend starts with
those that answer, warns about the others, which join the routing when they answer, and
fails only when none answers within ``startup_timeout_s`` or one answers without token ids.
Requests run on a private event loop in a background thread (:mod:`server_client`), reached
from ``generate`` (blocking) and ``generate_async`` (from any event loop) alike;
:mod:`server_routing` picks each request's server.

Rows with images (a vision-language model's prompts, with the row's PIL images in the
``images`` column) go as each dialect's multimodal input (:mod:`server_media`).

``update_weights`` makes vLLM and SGLang servers reload a checkpoint from their disk
(:mod:`server_weights`, the requests of :meth:`ServerDialect.weight_reload`); every
generated token is labelled with the policy version whose weights produced it.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from typing import Any

from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.loop_thread import LoopThread
from envloop.models.bundled import resolve_model
from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.generation_batches import (
    build_output,
    check_generation_input,
    finished_rows,
    generation_columns,
    sample_budgets,
)
from envloop.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from envloop.models.generation.policy_versions import next_policy_version
from envloop.models.generation.server_client import ServerClient
from envloop.models.generation.server_config import ServerGenerationConfig
from envloop.models.generation.server_dialects import GenerationRequest, Sampling, make_dialect
from envloop.models.generation.server_fleet import ServerFleet
from envloop.models.generation.server_media import VisionTokens, request_images
from envloop.models.generation.server_weights import WeightUpdateFailed
from envloop.models.tokenizers import apply_chat_template_settings

__all__ = ["ServerGeneration", "ServerGenerationConfig", "WeightUpdateFailed"]

_SEED_STRIDE = 1_000_003


class ServerGeneration(GenerationInterface):
    """A policy served by one or more inference servers of one ``dialect``.

    ``logprobs[i, t]`` of a sampled token is its log-probability under the distribution it
    was drawn from (temperature, then top-k, then top-p, as ``HfGeneration``), as the
    server reports it: llama.cpp always, vLLM when serving with
    ``--logprobs-mode processed_logprobs`` (its default, ``raw_logprobs``, reports the
    unfiltered temperature-1 values), SGLang with its temperature applied (the config
    refuses top-k and top-p for it). A greedy token's is the model's unfiltered
    log-probability at temperature 1 on every server (``HfGeneration`` reports the same
    for greedy decoding at temperature 1 without top-k and top-p).

    Stop strings are applied by the server and kept in the output; the budget of each row
    is the smaller of ``max_new_tokens`` and the row's own. A row whose request fails after
    its retries comes back with no tokens and its error in ``generation_error`` (the
    rollout engine ends that sample with ``loss_multiplier`` 0); the other rows are not
    affected. Each sampled request gets a seed derived from ``seed`` and its position
    among this instance's requests, so a fresh instance repeats a sequence of calls as far
    as the server's sampling is deterministic.

    Samples of one prompt (consecutive rows with the same text prompt, budget and stop
    strings) go as one request for several completions where a server takes it
    (llama.cpp: up to its slots), each row with its own seed: the same tokens as a request
    per row, at a fraction of the client's CPU (docs/server_fleets.md). Where seeds do not
    matter (greedy decoding, or ``seed: None``), or where the server samples each listed
    prompt with its own seed (SGLang), rows of different prompts with one budget and stop
    strings go as one request listing their prompts.

    Images: a batch may carry an ``images`` column, one entry per row (None, or the row's
    PIL images in the order of its image placeholder spans), beside its vision columns
    (``image_grid_thw`` gives the size each image was processed at). Each image goes to
    the server at that size (:mod:`server_media`); a row whose images the server counts as
    a different number of prompt tokens fails with the reason. Image rows for a dialect or
    server that takes no images raise ``ValueError`` before anything is sent.

    Weight updates: :meth:`update_weights` makes every server reload a checkpoint from its
    disk, and ``policy_versions`` labels each generated token with the version of the
    weights that produced it (0 until the first update). The label is exact for this
    instance's requests: an update holds new requests back, waits until every request
    already sent is answered (a retry waits like a new request), reloads, and only then
    lets requests go, labelled with the new version. vLLM is also paused around the reload
    (``mode=wait``: requests of other clients finish first, then its prefix cache is
    cleared); SGLang holds its own lock for the reload (running requests finish first, new
    ones wait) and flushes its cache. llama.cpp cannot reload weights.

    Attributes:
        config: the validated :class:`ServerGenerationConfig`.
        tokenizer: the served model's tokenizer (the rollout engine tokenizes with it).
        model: the served model's name (vLLM's, as given or as its server lists it).
        vision: the served model's image token ids (None for a text-only model).
        processor: the served vision-language model's processor (the rollout engine
            tokenizes image prompts with it), None for a text-only model.
    """

    reads_images = True  # sends the rows' PIL images, checked against image_grid_thw

    def __init__(self, config: ServerGenerationConfig | Mapping[str, Any]) -> None:
        from transformers import AutoTokenizer

        if not isinstance(config, ServerGenerationConfig):
            config = ServerGenerationConfig.from_mapping(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.tokenizer))
        self.vision = _vision_tokens(config.tokenizer)
        self.processor = None
        if self.vision is not None:
            from envloop.models.processors import load_processor

            self.processor = load_processor(resolve_model(config.tokenizer))
        for tokenizer in (self.tokenizer, self.processor):
            if tokenizer is not None:
                apply_chat_template_settings(
                    tokenizer, config.chat_template, config.chat_template_kwargs
                )
        self.pad_id = _pad_id(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self._requests_made = 0
        self._updating = threading.Lock()
        self._loop = LoopThread("envloop-server-client")
        dialect = make_dialect(config.dialect, config.model, self._decode)
        self._client = ServerClient(config, dialect, self.vocab_size)
        self._fleet: ServerFleet | None = None
        try:
            self._loop.run(self._client.open())
            waiting = self._loop.run(self._start())
        except BaseException:
            self.shutdown()
            raise
        if waiting:
            warnings.warn(
                f"Starting with {len(self._client.router.joined)} of {len(config.base_urls)} "
                f"server(s); not answering yet: {'; '.join(waiting)}. Each joins the routing "
                "when it answers its probe request.",
                stacklevel=2,
            )

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row (see the class docstring); rows in input order."""
        batch, groups = self._prepare(data, greedy)
        futures = [self._loop.submit(call) for _, call in groups]
        try:
            results = [result for future in futures for result in future.result()]
        finally:  # interrupted: stop waiting on the servers for rows nobody will read
            for future in futures:
                future.cancel()
        return self._output(batch, list(range(len(results))), results)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row, one-row output)`` as each row's request comes back; every row's
        request is sent at once (up to ``max_concurrent_requests`` over all calls)."""
        batch, groups = self._prepare(data, greedy)
        futures = [self._loop.submit(call) for _, call in groups]
        try:
            async for group, results in finished_rows(futures):
                for row, result in enumerate(results, start=groups[group][0]):
                    yield row, self._output(batch, [row], [result])
        finally:
            for future in futures:
                future.cancel()

    @property
    def model(self) -> str | None:
        """The served model's name: ``config.model``, or for vLLM without one the first
        model its server lists (None where the dialect takes no name)."""
        return self._client.dialect.model

    @property
    def policy_version(self) -> int:
        """The version of the weights the servers serve: 0 after construction, then what
        each successful :meth:`update_weights` set."""
        return self._client.version

    def update_weights(
        self, checkpoint: str | os.PathLike[str], *, version: int | None = None
    ) -> int:
        """Make every server serve the checkpoint at ``checkpoint`` and return its version.

        ``checkpoint`` is the absolute path, on the servers' machines, of what their model
        loaders read: with their default load format, a folder such as ``save_pretrained``
        writes, holding weights for the served model's architecture and sizes. ``version``
        None means the current version plus one; an explicit one must not be lower than
        the current. Requests are held back and drained around the reload (see the class
        docstring); all servers reload concurrently. If any fails,
        :class:`WeightUpdateFailed` lists each failed server with its error and the version
        stays as it was (the servers that did reload serve the new weights already: update
        again once the others are fixed). On llama.cpp servers, ``NotImplementedError`` says
        how to restart them; that and bad arguments are raised before anything is sent.
        """
        with self._updating:
            self._check_reloadable()
            path = _checkpoint_path(checkpoint)
            new_version = next_policy_version(self.policy_version, version)
            reload = self._client.dialect.weight_reload(path, new_version)
            failed = self._loop.run(self._client.update_weights(reload, new_version))
            if failed:
                raise WeightUpdateFailed(self._update_failure(path, failed))
            return new_version

    def request_stats(self) -> dict[str, Any]:
        """Counters of this backend's HTTP requests (``requests``, ``retries``,
        ``failed_rows``, ``score_requests``: the follow-up requests its dialect sent to fill
        log-probabilities a reply lacked, llama.cpp's scoring requests) and each server's
        ``outstanding`` and ``answered`` completions (rows; a request for a prompt's samples
        counts each), by URL; ``joined``: the URLs of the servers that take requests."""
        servers = {s.url: s.outstanding for s in self._client.router.servers}
        router = self._client.router
        answered = {s.url: s.answered for s in router.servers}
        joined = [s.url for s in router.joined]
        return {**self._client.counts, "outstanding": servers, "answered": answered,
                "joined": joined}  # fmt: skip

    def shutdown(self) -> bool:
        """Close the HTTP session and stop the client's thread; the instance is unusable
        afterwards."""
        if self._loop.running:
            if self._fleet is not None:
                self._loop.run(self._fleet.close())
            self._loop.run(self._client.close())
            self._loop.close(wait=True)
        return True

    def _prepare(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[
        BatchedDataDict[GenerationDatumSpec],
        list[tuple[int, Coroutine[Any, Any, list[SampleResult]]]],
    ]:  # fmt: skip
        """The batch's columns and, for each group of rows sent together, its first row
        and the call that gives the group's results in row order, up to what every joined
        server takes (``ServerRouter.group_size``: llama.cpp's slots):

        - consecutive text rows with the same prompt, budget and stop strings (a prompt's
          samples) go as one request for several completions, each row with its own seed,
          so each row gets the tokens a request of its own would give;
        - where seeds do not matter (greedy decoding, or ``seed: null``), or where the
          dialect gives each listed prompt its own seed (SGLang), consecutive text rows of
          other prompts with one budget and stop strings go as one request listing their
          prompts (llama.cpp samples them all with one seed, which a seeded run must not
          do: its rows go one request each)."""
        check_generation_input(data, self.vocab_size)
        images = self._row_images(data)
        batch = generation_columns(data)
        budgets = sample_budgets(batch, self.config.max_new_tokens)
        stops = batch.get("stop_strings") or [None] * len(budgets)
        keys = batch.get("sample_ids") or [None] * len(budgets)
        sampling = Sampling(
            self.config.temperature, self.config.top_p, self.config.top_k, greedy=greedy
        )
        limit = self._client.router.group_size()
        runs: list[list[GenerationRequest]] = []  # a prompt's samples each
        for row, (ids, length, budget, stop) in enumerate(
            zip(batch["input_ids"].tolist(), batch["input_lengths"].tolist(), budgets, stops)
        ):  # the tensors as lists once per batch, not per row
            prompt = ids[:length]
            media = images(row, prompt) if images is not None else None
            request = GenerationRequest(prompt, budget, stop, self._next_seed(), media)
            run = runs[-1] if runs else None
            if run is not None and len(run) < limit and _same_prompt(run[0], request, len(run)):
                run.append(request)
            else:
                runs.append([request])
        listable = greedy or self.config.seed is None or self._client.dialect.seeds_listed_prompts
        groups: list[tuple[int, Coroutine[Any, Any, list[SampleResult]]]] = []
        first = 0
        for group, one_prompt in _listed(runs, limit) if listable else ((r, True) for r in runs):
            rows = slice(first, first + len(group))
            if one_prompt:
                call = self._client.generate_group(group[0], len(group), sampling, keys[rows])
            else:
                call = self._client.generate_batch(group, sampling, keys[rows])
            groups.append((first, call))
            first += len(group)
        return batch, groups

    def _row_images(self, data: BatchedDataDict[GenerationDatumSpec]) -> Any:
        """A function of (row, prompt) giving the row's request images, or None when the
        batch has no images; raises ``ValueError`` when these servers cannot take them."""
        column = data.get("images")
        if column is None or not any(column):
            return None
        if not isinstance(column, list) or len(column) != len(data["input_ids"]):
            raise ValueError(
                f"images: expected a list of {len(data['input_ids'])} entries, one per row "
                "(None or the row's PIL images)"
            )
        self._check_takes_images()
        grids = data.get("image_grid_thw")
        vision = self.vision
        assert vision is not None

        def row_images(row: int, prompt: list[int]) -> Any:
            if not column[row]:
                return None
            grid = grids[row] if isinstance(grids, PackedTensor) else None
            return request_images(row, prompt, column[row], grid, vision)

        return row_images

    def _check_takes_images(self) -> None:
        config, dialect = self.config, self._client.dialect
        if self.vision is None:
            raise ValueError(
                f"The batch has images but the tokenizer {config.tokenizer!r} belongs to no "
                "vision-language model (its config has no vision part and image token ids); "
                "set tokenizer to the served VLM's folder or hub id."
            )
        if dialect.images_refused is not None:
            raise ValueError(
                f"The batch has images but dialect {config.dialect!r} cannot send them: "
                f"{dialect.images_refused}."
            )
        for server in self._client.router.joined:
            refused = dialect.images_refused_by(server.media)
            if refused is not None:
                raise ValueError(f"The batch has images but {server.url} {refused}.")

    def _check_reloadable(self) -> None:
        refused = self._client.dialect.weights_refused
        if refused is not None:
            urls = ", ".join(server.url for server in self._client.router.servers)
            raise NotImplementedError(f"update_weights ({urls}): {refused}.")

    def _update_failure(self, checkpoint: str, failed: dict[str, str]) -> str:
        """The error of an update that failed on the servers of ``failed`` (URL: error)."""
        urls = [server.url for server in self._client.router.joined]
        lines = [
            f"update_weights({checkpoint!r}) failed on {len(failed)} of {len(urls)} "
            f"server(s); the policy version stays {self.policy_version}:",
            *(f"  - {url}: {error}" for url, error in failed.items()),
        ]
        reloaded = [url for url in urls if url not in failed]
        if reloaded:
            lines.append(
                f"  {', '.join(reloaded)} reloaded and already serve the new weights; call "
                "update_weights again with this checkpoint once the others are fixed."
            )
        lines.append(f"  Check: {self._client.dialect.reload_needs}.")
        return "\n".join(lines)

    def _decode(self, ids: list[int]) -> str:
        return str(
            self.tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _next_seed(self) -> int | None:
        self._requests_made += 1
        if self.config.seed is None:
            return None
        return (self.config.seed * _SEED_STRIDE + self._requests_made) % 2**31

    def _output(
        self, batch: BatchedDataDict[GenerationDatumSpec], rows: list[int],
        results: list[SampleResult],
    ) -> BatchedDataDict[GenerationOutputSpec]:  # fmt: skip
        ids, lengths = batch["input_ids"][rows], batch["input_lengths"][rows]
        output = build_output(ids, lengths, results, self.pad_id)
        output["generation_error"] = [result.error for result in results]
        return output

    async def _start(self) -> list[str]:
        """Start with the servers that answer their probe (:mod:`server_fleet`); returns
        each server still waiting, with its last error."""
        vision = self.vision is not None
        self._fleet = ServerFleet(
            self._client, _probe_token(self.tokenizer), vision, self.config.tokenizer
        )
        return await self._fleet.start(self.config.startup_timeout_s)


def _listed(
    runs: list[list[GenerationRequest]], limit: int
) -> Iterator[tuple[list[GenerationRequest], bool]]:
    """``runs`` (a prompt's samples each) as the groups sent together where seeds do not
    matter, each with whether it is one prompt's samples: runs of one row in a row with
    the same budget and stop strings and no images join into lists of up to ``limit``
    prompts; longer runs stay one prompt's (its prompt is then processed once)."""
    listed: list[GenerationRequest] = []
    for run in runs:
        request = run[0]
        single = len(run) == 1 and request.images is None
        if listed and not (
            single and len(listed) < limit
            and request.budget == listed[0].budget and request.stops == listed[0].stops
        ):  # fmt: skip
            yield listed, len(listed) == 1
            listed = []
        if single:
            listed.append(request)
        else:
            yield run, True
    if listed:
        yield listed, len(listed) == 1


def _same_prompt(first: GenerationRequest, request: GenerationRequest, j: int) -> bool:
    """Whether ``request`` is completion ``j`` of a group that starts with ``first``: same
    text prompt, budget and stop strings, and seed ``first.seed + j`` (or both unseeded)."""
    if first.images is not None or request.images is not None:
        return False
    if first.seed is None or request.seed is None:
        seeded = first.seed is None and request.seed is None
    else:
        seeded = request.seed == first.seed + j
    return (
        seeded and request.budget == first.budget and request.stops == first.stops
        and request.prompt == first.prompt
    )  # fmt: skip


def _pad_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            return value
    return 0


def _probe_token(tokenizer: Any) -> int:
    ids = tokenizer("Hello", add_special_tokens=False).input_ids
    return int(ids[0]) if ids else 0


def _vision_tokens(tokenizer: str) -> VisionTokens | None:
    """The image token ids of the model whose tokenizer is ``tokenizer`` (None when its
    config cannot be read or has no vision part)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model(tokenizer))
    except (OSError, ValueError):
        return None
    return VisionTokens.from_config(config)


def _checkpoint_path(checkpoint: Any) -> str:
    """``checkpoint`` as the absolute path sent to the servers; raises for anything else."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"update_weights(checkpoint={type(checkpoint).__name__}): expected the path (str "
            "or os.PathLike) of a checkpoint the servers can read; ServerGeneration sends "
            "servers a path, not weights: save them first (save_pretrained(folder))."
        )
    path = os.fspath(checkpoint)
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(
            f"update_weights(checkpoint={path!r}): expected an absolute path, which each "
            "server reads on its own machine (a relative one would be resolved against "
            "its working directory); e.g. os.path.abspath(checkpoint) when the servers "
            "share this machine's files."
        )
    return path
