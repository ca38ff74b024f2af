"""``HfGeneration``: a transformers causal LM behind ``GenerationInterface``.

Decoding is our own loop over a KV cache (``decode_loop``), not ``model.generate``, so each
reported log-probability is exactly that of the distribution its token was drawn from.
With ``num_workers > 1`` the batch is split across that many Ray actors, each holding a copy
of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.decode_loop import DecodeSettings, SampleResult, decode
from envloop.models.generation.generation_batches import (
    build_output,
    check_generation_input,
    generation_columns,
    sample_budgets,
)
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from envloop.models.generation.threads import set_cpu_threads

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HfGeneration(GenerationInterface):
    """Generation with a transformers causal LM on CPU or GPU, in-process or on Ray actors.

    ``logprobs[i, t]`` of a generated token is ``log_softmax(filter(logits / temperature))``
    at that token, where ``filter`` keeps the ``top_k`` largest logits, then the smallest set
    of most likely tokens with probability mass >= ``top_p``, and sets the others to -inf:
    exactly the distribution the token was sampled from. Greedy decoding takes the argmax of
    that same distribution and reports its log-probability the same way.

    A sample stops at an EOS token (any of the tokenizer's, model config's and generation
    config's EOS ids; the EOS is kept), when its generated text contains one of its stop
    strings (checked after every token, so the text ends with the stop string, or a few
    characters past it when the last token runs on; kept), or at its token budget
    (``truncated=True``). The sampling generator is seeded once, on construction: a fresh
    instance repeats the same calls exactly, and later calls draw new samples.

    Attributes:
        config: the validated :class:`HfGenerationConfig` (given as one or as a mapping).
        tokenizer: the loaded tokenizer (also what the rollout engine tokenizes with).
        model: the loaded model; None when the work runs on Ray actors.
        on_decode_step: None, or a function called after every decode step of in-process
            generation with the number of tokens that step generated (e.g. a live token
            count; worker actors do not report steps).
    """

    def __init__(self, config: HfGenerationConfig | Mapping[str, Any]) -> None:
        from transformers import AutoTokenizer

        if not isinstance(config, HfGenerationConfig):
            config = HfGenerationConfig.from_mapping(config)
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.tokenizer_name))
        self.pad_id = _pad_token_id(self.tokenizer, config.tokenizer_name)
        self.model: Any = None
        self.on_decode_step: Callable[[int], None] | None = None
        self._workers: list[Any] = []
        if config.num_workers > 1:
            self._workers = _start_workers(config)
            return
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu":
            set_cpu_threads(config.cpu_threads)
        self.model = _load_model(config, self.device)
        self.eos_ids = _eos_token_ids(self.tokenizer, self.model)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row (see the class docstring); rows in input order."""
        if self._workers:
            return self._generate_on_workers(data, greedy)
        check_generation_input(data, self.model.get_input_embeddings().num_embeddings)
        batch = generation_columns(data)
        size, step = batch["input_ids"].shape[0], self.config.micro_batch_size
        if size == 0:
            return build_output(batch["input_ids"], batch["input_lengths"], [], self.pad_id)
        parts = [
            self._generate_rows(batch.slice(i, i + step), greedy) for i in range(0, size, step)
        ]
        return BatchedDataDict.from_batches(parts, _OUTPUT_PAD_VALUES | {"output_ids": self.pad_id})

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the model (on every worker) in eval mode; weights already sit on the device."""
        if self._workers:
            import ray

            return all(ray.get([w.prepare_for_generation.remote() for w in self._workers]))
        self.model.eval()
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Nothing to release: the model stays loaded between generation rounds."""
        return True

    def shutdown(self) -> bool:
        """Kill the worker actors and drop the model; the instance is unusable afterwards."""
        if self._workers:
            import ray

            for worker in self._workers:
                ray.kill(worker)
        self._workers = []
        self.model = None
        return True

    def _generate_rows(
        self, batch: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """One micro-batch through the decode loop."""
        input_ids, lengths = batch["input_ids"], batch["input_lengths"]
        prompts = [ids[: int(n)] for ids, n in zip(input_ids, lengths)]
        stops = batch.get("stop_strings") or [None] * len(prompts)
        results: list[SampleResult] = decode(
            self.model,
            self.tokenizer,
            prompts,
            sample_budgets(batch, self.config.max_new_tokens),
            stops,
            self._decode_settings(greedy),
            self.generator,
            self.on_decode_step,
        )
        return build_output(input_ids, lengths, results, self.pad_id)

    def _decode_settings(self, greedy: bool) -> DecodeSettings:
        cfg = self.config
        return DecodeSettings(
            cfg.temperature, cfg.top_k, cfg.top_p, greedy, self.eos_ids, self.pad_id
        )

    def _generate_on_workers(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Contiguous shards to the workers in parallel, concatenated back in input order."""
        import ray

        check_generation_input(data, vocab_size=None)
        data = generation_columns(data)
        shards = data.shard_by_batch_size(len(self._workers), allow_uneven_shards=True)
        jobs = [(w, s) for w, s in zip(self._workers, shards) if s.size] or [
            (self._workers[0], data)
        ]
        outputs = ray.get([worker.generate.remote(shard, greedy) for worker, shard in jobs])
        return BatchedDataDict.from_batches(
            outputs, _OUTPUT_PAD_VALUES | {"output_ids": self.pad_id}
        )


_OUTPUT_PAD_VALUES: dict[str, int | float] = {"logprobs": 0.0}


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "HfGenerationConfig.device='cuda' but no CUDA device is visible; "
            "use device='cpu' or 'auto'."
        )
    return torch.device(device)


def _load_model(config: HfGenerationConfig, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        resolve_model(config.model_name), dtype=_DTYPES[config.dtype]
    )
    return model.to(device).eval()


def _pad_token_id(tokenizer: Any, name: str | None) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"The tokenizer {name!r} has no pad token, which HfGeneration needs to pad outputs. "
            "Set one and save the tokenizer (tokenizer.pad_token = '<unused token>'; "
            "tokenizer.save_pretrained(folder)), then point tokenizer_name at that folder."
        )
    return int(tokenizer.pad_token_id)


def _eos_token_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    """Every EOS id named by the tokenizer, the model config and its generation config."""
    generation_config = getattr(model, "generation_config", None)
    sources = [
        tokenizer.eos_token_id,
        getattr(model.config, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
    ]
    ids: set[int] = set()
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    if not ids:
        raise ValueError("Neither the tokenizer nor the model config names an EOS token id.")
    return frozenset(ids)


def _start_workers(config: HfGenerationConfig) -> list[Any]:
    """``num_workers`` Ray actors, each an in-process HfGeneration seeded ``seed + rank``.

    Returns once every actor has loaded its model, so a loading error surfaces here.
    """
    import ray

    actor_class: Any = ray.remote(num_cpus=config.worker_num_cpus, num_gpus=config.worker_num_gpus)(
        HfGeneration
    )
    workers = [
        actor_class.remote(config.model_copy(update={"num_workers": 1, "seed": config.seed + rank}))
        for rank in range(config.num_workers)
    ]
    try:
        ray.get([worker.prepare_for_generation.remote() for worker in workers])
    except Exception:
        for worker in workers:
            ray.kill(worker)
        raise
    return workers
