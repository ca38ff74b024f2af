"""``HfGeneration``: a transformers causal LM, or vision-language model, behind
``GenerationInterface``.

Decoding is our own loop over a KV cache (``decode_loop``), not ``model.generate``, so each
reported log-probability is exactly that of the distribution its token was drawn from. The
loop batches continuously (``continuous_batching``): ``generate`` and ``generate_async``
calls, from any thread, feed one loop, which admits requests whenever a row is free. With
``num_workers > 1`` the work goes to that many Ray actors (``hf_workers``), each holding a
copy of the model. ``update_weights`` swaps in new weights between two decode steps while
the loop serves (``hf_weights`` checks and prepares them first).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import Future, as_completed
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.continuous_batching import ContinuousBatcher
from envloop.models.generation.decode_loop import DecodeRequest, DecodeSettings, SampleResult
from envloop.models.generation.generation_batches import (
    build_output,
    check_generation_input,
    finished_rows,
    generation_columns,
    sample_budgets,
)
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.hf_models import (
    eos_token_ids,
    is_vision_language,
    load_model,
    load_tokenizers,
    pad_token_id,
    resolve_device,
)
from envloop.models.generation.hf_vision import row_visions
from envloop.models.generation.hf_weights import (
    StagedWeights,
    WeightSpec,
    WeightsSource,
    stage_weights,
)
from envloop.models.generation.hf_workers import WorkerPool
from envloop.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from envloop.models.generation.policy_versions import next_policy_version
from envloop.models.generation.threads import set_cpu_threads


class HfGeneration(GenerationInterface):
    """Generation with a transformers causal LM on CPU or GPU, in-process or on Ray actors.

    ``logprobs[i, t]`` of a generated token is ``log_softmax(filter(logits / temperature))``
    at that token, where ``filter`` keeps the ``top_k`` largest logits, then the smallest set
    of most likely tokens with probability mass >= ``top_p``, and sets the others to -inf:
    exactly the distribution the token was sampled from. Greedy decoding takes the argmax of
    that same distribution and reports its log-probability the same way.

    A sample stops at an EOS token (any of the tokenizer's, model config's and generation
    config's EOS ids; the EOS is kept), when its generated text comes to hold one of its stop
    strings (watched token by token, so the text ends with the stop string, or a few
    characters past it when the last token runs on; kept), or at its token budget
    (``truncated=True``).

    Every call's rows join one decode loop of up to ``micro_batch_size`` rows, which admits
    waiting rows at every step as others finish (continuous batching), so rows of
    concurrent ``generate_async`` calls share forward passes. Each sampled row draws from
    a random stream of its own, seeded from the backend's generator (seeded once, on
    construction) when the row is submitted: a fresh instance repeats the same sequence of
    calls exactly, later calls draw new samples, and a row's tokens do not depend on which
    rows share its steps (up to float rounding of batched matmuls, as for greedy rows).

    A model whose config has a vision part (Qwen2/2.5/3-VL are tested) loads with
    ``AutoModelForImageTextToText`` and its processor; rows then carry their images' vision
    inputs as ``PackedTensor`` columns (``pixel_values``, ``image_grid_thw``; see
    ``envloop.data.multimodal_utils``), which go to the model with the row's prefill, and
    each row keeps its own rotary positions (Qwen-VL's 3-D ones). Logprobs are defined as
    above, with the row's images.

    :meth:`update_weights` serves new weights without stopping the decode loop; the output's
    ``policy_versions`` [B, L'] gives each generated token the version of the weights that
    computed the logits it was drawn from.

    Attributes:
        config: the validated :class:`HfGenerationConfig` (given as one or as a mapping).
        tokenizer: the loaded tokenizer (also what the rollout engine tokenizes with).
        processor: a vision-language model's processor (what the rollout engine tokenizes
            image conversations with), else None.
        model: the loaded model; None when the work runs on Ray actors.
        on_decode_step: None, or a function called after every decode step of in-process
            generation with the number of tokens that step generated (e.g. a live token
            count). It runs on the decode loop's thread; worker actors do not report steps.
    """

    def __init__(self, config: HfGenerationConfig | Mapping[str, Any]) -> None:
        if not isinstance(config, HfGenerationConfig):
            config = HfGenerationConfig.from_mapping(config)
        self.config = config
        vision_language = is_vision_language(config.model_name)
        tokenizers = load_tokenizers(config, vision_language)
        self.tokenizer, self.processor = tokenizers.tokenizer, tokenizers.processor
        self.pad_id = pad_token_id(self.tokenizer, config.tokenizer_name)
        self.model: Any = None
        self.on_decode_step: Callable[[int], None] | None = None
        self._pool: WorkerPool | None = None
        self._update_lock = threading.Lock()
        self._latest_version = 0
        """The version of the last update queued (served once the loop applies it)."""
        self._staged: tuple[int, StagedWeights] | None = None
        if config.num_workers > 1:
            self._pool = WorkerPool.start(HfGeneration, config, self._pad_values())
            return
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        self.model = load_model(config, self.device, vision_language)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        settings = DecodeSettings(
            config.temperature, config.top_k, config.top_p, self.eos_ids, self.pad_id
        )
        self._batcher = ContinuousBatcher(
            self.model, self.tokenizer, settings, self.generator, config.micro_batch_size,
            self._count_step, recompute_on_update=config.kv_cache_on_update == "recompute",
        )  # fmt: skip

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row (see the class docstring); rows in input order."""
        if self._pool is not None:
            check_generation_input(data, vocab_size=None)
            return self._pool.generate(generation_columns(data), greedy)
        batch, jobs = self._submit(data, greedy)
        try:
            results = [future.result() for _, future in jobs]
        finally:  # interrupted: the loop drops the rows nobody will read
            _abandon(jobs)
        return build_output(batch["input_ids"], batch["input_lengths"], results, self.pad_id)

    def iter_generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> Iterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Queue every row now, and iterate over ``(row, one-row output)`` as each row
        finishes (the blocking form of :meth:`generate_async`; in-process only). Closing
        the iterator early drops the rows still running."""
        batch, jobs = self._submit(data, greedy)
        return self._as_finished(batch, jobs)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row, one-row output)`` as each row finishes. Rows join the running decode
        loop (or, with workers, the least-loaded worker's) at its next step; the event loop
        is never blocked."""
        if self._pool is not None:
            check_generation_input(data, vocab_size=None)
            async for item in self._pool.generate_async(generation_columns(data), greedy):
                yield item
            return
        batch, jobs = self._submit(data, greedy)
        try:
            async for row, result in finished_rows([future for _, future in jobs]):
                yield row, self._row_output(batch, row, result)
        finally:
            _abandon(jobs)

    def update_weights(self, weights: WeightsSource, *, version: int | None = None) -> int:
        """Serve ``weights`` from the next decode step on; returns their policy version.

        ``weights``: a state dict (``model.state_dict()`` of a trainer's copy: this model's
        keys with its shapes, any dtype and device), a ``torch.nn.Module`` of the same
        architecture, or a folder written by ``save_pretrained`` (safetensors, one file or
        shards with their index). Tied weights (an LM head tied to the embeddings) need only
        one of their keys. Weights that do not fit raise one ``ValueError`` listing every
        missing key, unexpected key and wrong shape, and nothing changes: the new tensors are
        all checked, cast and moved before the model is touched. ``version``: None for the
        next one (:attr:`policy_version` + 1); an explicit one must not be lower.

        The decode loop goes on serving: the update lands between two of its steps (at once
        while it is idle, or when called from :attr:`on_decode_step`), and this call returns
        once it is applied. Rows admitted afterwards are prefilled with the new weights. A
        row in flight keeps the tokens it has and goes on under the new weights (a partial
        rollout); ``config.kv_cache_on_update`` says what happens to its KV cache:

        - ``keep`` (default): the cache and the pending next-token logits stay as the old
          weights computed them. The row's next token is drawn from those logits, so it is
          of the old version; the tokens after it are of the new version, computed by the
          new weights attending to the old weights' keys and values for every position
          before the update.
        - ``recompute``: the row's cache and logits are rebuilt by prefilling its whole
          sequence so far (prompt + generated tokens, with its images) under the new
          weights, so its very next token is of the new version and every token from the
          update on is what the new weights give for the sequence before it.

        With ``num_workers > 1`` a state dict or module is checked here against the
        workers' model, put in Ray's object store once, and the same reference goes to
        every worker; a folder goes as its absolute path (each worker loads it, so it must
        be readable there). Every worker first checks and prepares the new tensors; only
        when all have them does any apply them, so an input that fails anywhere changes no
        worker. Each worker applies them between two of its own steps (not at the same
        moment as the others); the call returns once every worker serves the new version.

        The given tensors are read until the call returns: do not change them meanwhile.
        Concurrent calls are applied in the order they were made.
        """
        if self._pool is not None:
            with self._update_lock:
                new = next_policy_version(self.policy_version, version)
                self._pool.update_weights(weights, new)
                self._policy_version = new
            return new
        with self._update_lock:  # versions handed out and updates queued in call order
            new = next_policy_version(self._latest_version, version)
            staged = stage_weights(self.model, weights)
            applied = self._batcher.update(functools.partial(self._serve, staged, new), new)
            self._latest_version = new
        applied.result()  # not under the lock: a call from on_decode_step may come first
        return new

    def decode_stats(self) -> list[dict[str, int]]:
        """The counters of each decode loop (this process's, or one per worker):
        ``requests``, ``prefills``, ``decode_steps``, ``joined_running`` (requests admitted
        while other rows were mid-generation) and ``peak_rows``."""
        if self._pool is not None:
            return self._pool.stats()
        return [self._batcher.stats.as_dict()]

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the model (on every worker) in eval mode; weights already sit on the device."""
        if self._pool is not None:
            return self._pool.prepare()
        self.model.eval()
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to release: the model stays loaded between generation rounds."""
        return True

    def shutdown(self) -> bool:
        """Kill the worker actors and drop the model; the instance is unusable afterwards."""
        if self._pool is not None:
            self._pool.shutdown()
        self.model = None
        return True

    def _submit(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> tuple[BatchedDataDict[GenerationDatumSpec], list[tuple[DecodeRequest, Future[Any]]]]:
        """Check ``data`` and queue its rows on the decode loop, in row order."""
        check_generation_input(data, self.model.get_input_embeddings().num_embeddings)
        batch = generation_columns(data)
        input_ids, lengths = batch["input_ids"], batch["input_lengths"]
        prompts = [ids[: int(n)] for ids, n in zip(input_ids, lengths)]
        stops = batch.get("stop_strings") or [None] * len(prompts)
        budgets = sample_budgets(batch, self.config.max_new_tokens)
        visions = row_visions(batch, prompts, self.model)
        return batch, self._batcher.submit(prompts, budgets, stops, greedy, visions)

    async def _stream_rows(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """:meth:`generate_async` under the name a worker pool streams from. A worker actor
        is an asyncio actor (this class has async methods), so its calls must await: a
        blocking one would hold its event loop, and every other call would wait."""
        async for item in self.generate_async(data, greedy):
            yield item

    async def _generate_awaiting(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """:meth:`generate` for a worker actor: awaits its rows instead of blocking."""
        batch, jobs = self._submit(data, greedy)
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in jobs))
        finally:
            _abandon(jobs)
        return build_output(batch["input_ids"], batch["input_lengths"], results, self.pad_id)

    def _as_finished(
        self,
        batch: BatchedDataDict[GenerationDatumSpec],
        jobs: list[tuple[DecodeRequest, Future[Any]]],
    ) -> Iterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        rows = {future: row for row, (_, future) in enumerate(jobs)}
        try:
            for future in as_completed(rows):
                yield rows[future], self._row_output(batch, rows[future], future.result())
        finally:
            _abandon(jobs)

    def _row_output(
        self, batch: BatchedDataDict[GenerationDatumSpec], row: int, result: SampleResult
    ) -> BatchedDataDict[GenerationOutputSpec]:
        ids, lengths = batch["input_ids"][row : row + 1], batch["input_lengths"][row : row + 1]
        return build_output(ids, lengths, [result], self.pad_id)

    def _weight_spec(self) -> WeightSpec:
        """The keys and shapes of this worker's weights (the pool checks updates with it)."""
        return WeightSpec.of(self.model)

    async def _stage_weights(self, weights: WeightsSource, version: int) -> None:
        """A worker's first phase of :meth:`update_weights`: check and prepare ``weights``
        (off the actor's event loop) and keep them for :meth:`_commit_weights`."""
        next_policy_version(self.policy_version, version)
        staged = await asyncio.to_thread(stage_weights, self.model, weights)
        self._staged = (version, staged)

    async def _commit_weights(self, version: int) -> int:
        """A worker's second phase: apply the weights staged for ``version`` between two
        decode steps; returns once they are served."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"no weights staged for version {version}; stage them first")
        staged, self._staged = self._staged[1], None
        serve = functools.partial(self._serve, staged, version)
        await asyncio.wrap_future(self._batcher.update(serve, version))
        self._latest_version = version
        return version

    def _serve(self, staged: StagedWeights, version: int) -> None:
        """Put ``staged`` in the model (on the decode loop's thread, between two steps, or
        while it is idle); :attr:`policy_version` changes with the weights."""
        staged.apply()
        self._policy_version = version

    def _drop_staged_weights(self) -> None:
        """Forget staged weights (another worker could not stage its copy)."""
        self._staged = None

    def _count_step(self, tokens: int) -> None:
        if self.on_decode_step is not None:
            self.on_decode_step(tokens)

    def _pad_values(self) -> dict[str, int | float]:
        return _OUTPUT_PAD_VALUES | {"output_ids": self.pad_id}


def _abandon(jobs: list[tuple[DecodeRequest, Future[Any]]]) -> None:
    """Stop decoding the rows nobody will read."""
    for request, future in jobs:
        if not future.done():
            request.abandoned = True
            future.cancel()


_OUTPUT_PAD_VALUES: dict[str, int | float] = {"logprobs": 0.0}
