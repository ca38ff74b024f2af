"""``HfEngine``: one transformers model in this process and the decode loop that serves it.

Decoding is our own loop over a KV cache (``decode_loop``), not ``model.generate``, so each
reported log-probability is exactly that of the distribution its token was drawn from. The
loop batches continuously (``continuous_batching``): ``generate`` and ``generate_async``
calls, from any thread, feed one loop, which admits requests whenever a row is free.
``update_weights`` swaps in new weights between two decode steps while the loop serves
(``hf_weights`` checks and prepares them first).

The same class is what each worker actor of :class:`~hf_worker_pool.HfWorkerPool` hosts; the
methods that pool calls on its actors are public here: :meth:`HfEngine.generate_async`
(streamed), :meth:`HfEngine.generate_awaiting`, :meth:`HfEngine.weight_spec`,
:meth:`HfEngine.stage_weights`, :meth:`HfEngine.commit_weights`,
:meth:`HfEngine.drop_staged_weights`, :meth:`HfEngine.decode_stats` and
:meth:`HfEngine.prepare_for_generation`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
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
    Tokenizers,
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
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec
from envloop.models.generation.policy_versions import next_policy_version
from envloop.models.generation.threads import set_cpu_threads


class HfEngine:
    """``config.model_name`` loaded on ``config.device`` in this process, with its decode
    loop (see :class:`~hf_generation.HfGeneration` for what it generates).

    ``tokenizers`` are the loaded tokenizer and processor (None: load them from the config,
    as a worker actor does); ``vision_language`` whether the model has a vision part (None:
    read its config).

    Attributes:
        config: the validated :class:`HfGenerationConfig`.
        tokenizer: the tokenizer (stop strings are watched in its text).
        pad_id: the id that pads outputs.
        device: the device the model runs on.
        model: the loaded model in eval mode; None after :meth:`shutdown`.
        eos_ids: every EOS id a row stops at.
        generator: the random generator each sampled row's stream is seeded from.
        batcher: the continuous-batching decode loop.
        on_decode_step: None, or a function called after every decode step with the number
            of tokens that step generated; it runs on the decode loop's thread.
    """

    def __init__(
        self,
        config: HfGenerationConfig,
        tokenizers: Tokenizers | None = None,
        vision_language: bool | None = None,
    ) -> None:
        if vision_language is None:
            vision_language = is_vision_language(config.model_name)
        if tokenizers is None:
            tokenizers = load_tokenizers(config, vision_language)
        self.config, self.tokenizer = config, tokenizers.tokenizer
        self.pad_id = pad_token_id(self.tokenizer, config.tokenizer_name)
        self.on_decode_step: Callable[[int], None] | None = None
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        self.model: Any = load_model(config, self.device, vision_language)
        self.eos_ids = eos_token_ids(self.tokenizer, self.model)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        settings = DecodeSettings(
            config.temperature, config.top_k, config.top_p, self.eos_ids, self.pad_id
        )
        self.batcher = ContinuousBatcher(
            self.model, self.tokenizer, settings, self.generator, config.micro_batch_size,
            self._count_step, recompute_on_update=config.kv_cache_on_update == "recompute",
        )  # fmt: skip
        self._policy_version = 0
        """The version of the weights the loop serves (set on its thread with them)."""
        self._latest_version = 0
        """The version of the last update queued (served once the loop applies it)."""
        self._update_lock = threading.Lock()
        self._staged: tuple[int, StagedWeights] | None = None

    @property
    def policy_version(self) -> int:
        """The version of the weights the decode loop serves now."""
        return self._policy_version

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """One response per row, rows in input order (blocks until all finish)."""
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
        finishes. Closing the iterator early drops the rows still running."""
        batch, jobs = self._submit(data, greedy)
        return self._as_finished(batch, jobs)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row, one-row output)`` as each row finishes; rows join the running
        decode loop at its next step, and the event loop is never blocked (a worker actor
        streams its rows to the pool with this)."""
        batch, jobs = self._submit(data, greedy)
        try:
            async for row, result in finished_rows([future for _, future in jobs]):
                yield row, self._row_output(batch, row, result)
        finally:
            _abandon(jobs)

    async def generate_awaiting(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """:meth:`generate` for a worker actor: awaits its rows instead of blocking. A
        worker actor is an asyncio actor (this class has async methods), so its calls must
        await: a blocking one would hold its event loop, and every other call would wait."""
        batch, jobs = self._submit(data, greedy)
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for _, f in jobs))
        finally:
            _abandon(jobs)
        return build_output(batch["input_ids"], batch["input_lengths"], results, self.pad_id)

    def update_weights(self, weights: WeightsSource, *, version: int | None = None) -> int:
        """Serve ``weights`` from the next decode step on and return their version; returns
        once they are applied (see :meth:`HfGeneration.update_weights`)."""
        with self._update_lock:  # versions handed out and updates queued in call order
            new = next_policy_version(self._latest_version, version)
            staged = stage_weights(self.model, weights)
            applied = self.batcher.update(functools.partial(self._serve, staged, new), new)
            self._latest_version = new
        applied.result()  # not under the lock: a call from on_decode_step may come first
        return new

    def weight_spec(self) -> WeightSpec:
        """The keys and shapes of this model's weights (the pool checks updates with it)."""
        return WeightSpec.of(self.model)

    async def stage_weights(self, weights: WeightsSource, version: int) -> None:
        """A worker's first phase of an update: check and prepare ``weights`` (off the
        actor's event loop) and keep them for :meth:`commit_weights`."""
        next_policy_version(self.policy_version, version)
        staged = await asyncio.to_thread(stage_weights, self.model, weights)
        self._staged = (version, staged)

    async def commit_weights(self, version: int) -> int:
        """A worker's second phase: apply the weights staged for ``version`` between two
        decode steps; returns once they are served."""
        if self._staged is None or self._staged[0] != version:
            raise RuntimeError(f"no weights staged for version {version}; stage them first")
        staged, self._staged = self._staged[1], None
        serve = functools.partial(self._serve, staged, version)
        await asyncio.wrap_future(self.batcher.update(serve, version))
        self._latest_version = version
        return version

    def drop_staged_weights(self) -> None:
        """Forget staged weights (another worker could not stage its copy)."""
        self._staged = None

    def decode_stats(self) -> list[dict[str, int]]:
        """The decode loop's counters (one entry; see :meth:`HfGeneration.decode_stats`)."""
        return [self.batcher.stats.as_dict()]

    def prepare_for_generation(self) -> bool:
        """Put the model in eval mode; its weights already sit on the device."""
        self.model.eval()
        return True

    def shutdown(self) -> None:
        """Drop the model; the engine is unusable afterwards."""
        self.model = None

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
        return batch, self.batcher.submit(prompts, budgets, stops, greedy, visions)

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

    def _serve(self, staged: StagedWeights, version: int) -> None:
        """Put ``staged`` in the model (on the decode loop's thread, between two steps, or
        while it is idle); :attr:`policy_version` changes with the weights."""
        staged.apply()
        self._policy_version = version

    def _count_step(self, tokens: int) -> None:
        if self.on_decode_step is not None:
            self.on_decode_step(tokens)


def _abandon(jobs: list[tuple[DecodeRequest, Future[Any]]]) -> None:
    """Stop decoding the rows nobody will read."""
    for request, future in jobs:
        if not future.done():
            request.abandoned = True
            future.cancel()
