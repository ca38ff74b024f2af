"""``HfGeneration``: a transformers causal LM, or vision-language model, behind
``GenerationInterface``.

A facade over one of two engines, chosen by ``num_workers``: :class:`~hf_engine.HfEngine`
runs the model in this process (our own decode loop over a KV cache, batching continuously),
:class:`~hf_worker_pool.HfWorkerPool` runs that many Ray actors, each hosting an
``HfEngine`` with its own copy of the model. ``HfGeneration`` loads the tokenizer (and a
vision-language model's processor) the rollout engine tokenizes with, and hands every call
to its engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.hf_engine import HfEngine
from envloop.models.generation.hf_models import is_vision_language, load_tokenizers, pad_token_id
from envloop.models.generation.hf_weights import WeightsSource
from envloop.models.generation.hf_worker_pool import HfWorkerPool
from envloop.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)

__all__ = ["HfGeneration", "HfGenerationConfig"]


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
        pad_id: the id that pads outputs (``output_ids`` past each row's end).
        engine: what generates: an :class:`HfEngine` (the model in this process), or with
            ``num_workers > 1`` an :class:`HfWorkerPool` (Ray actors, each hosting an
            ``HfEngine``, placed by ``config.worker_placement``; a worker lost with its node
            is replaced and its rows generated again: see :meth:`worker_nodes`).
        model: the loaded model; None when the work runs on Ray actors (a property of
            the engine).
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
        self.engine: HfEngine | HfWorkerPool
        if config.num_workers > 1:
            self.engine = HfWorkerPool.start(config, self.pad_id)
        else:
            self.engine = HfEngine(config, tokenizers, vision_language)

    @property
    def model(self) -> Any:
        """The loaded model (None on Ray actors, or after :meth:`shutdown`)."""
        return self.engine.model

    @property
    def on_decode_step(self) -> Callable[[int], None] | None:
        """Called after every in-process decode step (see the class docstring)."""
        return self.engine.on_decode_step

    @on_decode_step.setter
    def on_decode_step(self, callback: Callable[[int], None] | None) -> None:
        self.engine.on_decode_step = callback

    @property
    def policy_version(self) -> int:
        """The version of the weights served now: 0 after construction, then what each
        :meth:`update_weights` set (in-process: once the decode loop applied them)."""
        return self.engine.policy_version

    @property
    def generation_retries(self) -> int:
        """Rows generated again because the worker actor generating them was lost (its node
        died), since construction; 0 in-process. See :meth:`worker_nodes`."""
        return self.engine.generation_retries if isinstance(self.engine, HfWorkerPool) else 0

    def worker_nodes(self) -> list[str]:
        """The Ray node id (hex) of each worker actor, in worker order; [] in-process.

        Workers go where ``config.worker_placement`` says (``default``, ``spread`` or
        ``resource:<name>``, as for environment actors). A worker lost with its node is
        replaced by a new actor of the same rank and seed, placed the same way on the nodes
        alive, serving the weights and policy version of the last :meth:`update_weights`;
        the rows the lost worker had not returned are generated again there from their
        prompts (:attr:`generation_retries` counts them; each row at most
        ``config.worker_max_retries`` times, after which it comes back with no tokens and
        its ``generation_error``). A regenerated row's tokens all carry the version served
        when it was generated again: the lost worker's partial tokens are never returned.
        """
        return self.engine.worker_nodes() if isinstance(self.engine, HfWorkerPool) else []

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row (see the class docstring); rows in input order."""
        return self.engine.generate(data, greedy)

    def iter_generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> Iterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Queue every row now, and iterate over ``(row, one-row output)`` as each row
        finishes (the blocking form of :meth:`generate_async`; in-process only). Closing
        the iterator early drops the rows still running."""
        return self.engine.iter_generate(data, greedy)

    async def generate_async(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> AsyncIterator[tuple[int, BatchedDataDict[GenerationOutputSpec]]]:
        """Yield ``(row, one-row output)`` as each row finishes. Rows join the running decode
        loop (or, with workers, the least-loaded worker's) at its next step; the event loop
        is never blocked."""
        async for item in self.engine.generate_async(data, greedy):
            yield item

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
        return self.engine.update_weights(weights, version=version)

    def decode_stats(self) -> list[dict[str, int]]:
        """The counters of each decode loop (this process's, or one per worker):
        ``requests``, ``prefills``, ``decode_steps``, ``joined_running`` (requests admitted
        while other rows were mid-generation) and ``peak_rows``."""
        return self.engine.decode_stats()

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the model (on every worker) in eval mode; weights already sit on the device."""
        return self.engine.prepare_for_generation()

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to release: the model stays loaded between generation rounds."""
        return True

    def shutdown(self) -> bool:
        """Kill the worker actors and drop the model; the instance is unusable afterwards."""
        self.engine.shutdown()
        return True
