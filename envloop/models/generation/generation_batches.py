"""Checking a ``GenerationDatumSpec`` batch and assembling a ``GenerationOutputSpec`` batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.decode_loop import SampleResult
from envloop.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec


def check_generation_input(data: Any, vocab_size: int | None) -> None:
    """Raise one ``ValueError`` naming every bad key of a generation input batch.

    Token ids are checked against ``vocab_size`` unless it is None.

    >>> batch = {"input_ids": torch.tensor([[5, 6, 0]]), "input_lengths": torch.tensor([2])}
    >>> check_generation_input(batch, vocab_size=10)
    >>> check_generation_input({**batch, "stop_strings": []}, vocab_size=10)
    Traceback (most recent call last):
    ...
    ValueError: Invalid generation input:
      - stop_strings: has 0 entries, expected one per sample (1)
    """
    if not isinstance(data, dict):
        raise TypeError(f"generate takes a BatchedDataDict, got {type(data).__name__}.")
    problems = _input_ids_problems(data.get("input_ids"), vocab_size)
    if problems:
        raise _input_error(problems)
    batch, width = data["input_ids"].shape
    problems += _lengths_problems(data.get("input_lengths"), batch, width)
    if data.get("stop_strings") is not None:
        problems += _stop_strings_problems(data["stop_strings"], batch)
    if data.get("max_new_tokens") is not None:
        problems += _budget_problems(data["max_new_tokens"], batch)
    sample_ids = data.get("sample_ids")
    if sample_ids is not None and (not isinstance(sample_ids, list) or len(sample_ids) != batch):
        problems.append(f"sample_ids: expected a list of {batch} keys, one per sample")
    if problems:
        raise _input_error(problems)


def generation_columns(data: Any) -> BatchedDataDict[GenerationDatumSpec]:
    """The input keys of ``GenerationDatumSpec`` present (and not None) in ``data``, and
    its packed vision columns (``PackedTensor`` values, e.g. ``pixel_values``).

    Other columns a caller keeps alongside (message logs, task names) are left out.

    >>> sorted(generation_columns({"input_ids": torch.zeros(1, 2), "extra": None}))
    ['input_ids']
    """
    keys = ("input_ids", "input_lengths", "stop_strings", "max_new_tokens", "sample_ids")
    columns = {k: data[k] for k in keys if data.get(k) is not None}
    columns.update((k, v) for k, v in data.items() if isinstance(v, PackedTensor))
    return BatchedDataDict(columns)


def sample_budgets(data: BatchedDataDict[GenerationDatumSpec], cap: int) -> list[int]:
    """Per-sample token budgets: ``min(data["max_new_tokens"][i], cap)``, or ``cap``.

    >>> sample_budgets({"input_ids": torch.zeros(2, 1), "max_new_tokens": torch.tensor([0, 9])}, 4)
    [0, 4]
    """
    budgets = data.get("max_new_tokens")
    if budgets is None:
        return [cap] * len(data["input_ids"])
    return [min(int(b), cap) for b in budgets.tolist()]


def build_output(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    results: Sequence[SampleResult],
    pad_id: int,
) -> BatchedDataDict[GenerationOutputSpec]:
    """Prompt + generated tokens, right-padded to ``max(L, longest sequence)`` columns.

    ``input_ids`` [B, L] and ``input_lengths`` [B] describe the prompts; tensors come back
    on the CPU. ``policy_versions`` [B, L'] int32 holds each generated token's version
    (``SampleResult.versions``; 0 where a result has none) and 0 at prompt and pad positions.
    """
    prompt_lengths = input_lengths.tolist()
    gen_lengths = [len(r.tokens) for r in results]
    total = [p + g for p, g in zip(prompt_lengths, gen_lengths)]
    rows, width = len(results), max([input_ids.shape[1], *total])
    # assembled in numpy: single-threaded (torch's parallel kernels would wake its thread
    # pool for these small copies), then handed to torch without a copy
    prompts = input_ids.cpu().numpy()
    starts = np.asarray(prompt_lengths, dtype=np.int64).reshape(rows)
    output_ids = np.full((rows, width), pad_id, dtype=np.int64)
    in_prompt = np.arange(prompts.shape[1]) < starts[:, None]
    output_ids[:, : prompts.shape[1]][in_prompt] = prompts[in_prompt]
    # every generated token at once: its row, and its column after its row's prompt
    counts = np.asarray(gen_lengths, dtype=np.int64).reshape(rows)
    row = np.repeat(np.arange(rows), counts)
    column = np.arange(len(row)) - (np.cumsum(counts) - counts)[row] + starts[row]
    chain = itertools.chain.from_iterable
    tokens = chain(r.tokens for r in results)
    output_ids[row, column] = np.fromiter(tokens, dtype=np.int64, count=len(row))
    logprobs = np.zeros((rows, width), dtype=np.float32)
    values = chain(r.logprobs for r in results)
    logprobs[row, column] = np.fromiter(values, dtype=np.float64, count=len(row))
    versions = np.zeros((rows, width), dtype=np.int32)
    labels = chain(r.versions or [0] * len(r.tokens) for r in results)
    versions[row, column] = np.fromiter(labels, dtype=np.int64, count=len(row))
    return BatchedDataDict(
        output_ids=torch.from_numpy(output_ids),
        generation_lengths=torch.from_numpy(counts),
        unpadded_sequence_lengths=torch.tensor(total, dtype=torch.long),
        logprobs=torch.from_numpy(logprobs),
        truncated=torch.tensor([r.truncated for r in results], dtype=torch.bool),
        policy_versions=torch.from_numpy(versions),
    )


T = TypeVar("T")


async def finished_rows(
    futures: Sequence[concurrent.futures.Future[T]],
) -> AsyncIterator[tuple[int, T]]:
    """``(row, result)`` of each of ``futures`` (one per row, completed on other threads) as
    it finishes, without blocking the event loop; rows that finish together in row order.
    Cancelling what is left when the caller stops is the caller's."""
    rows = {asyncio.wrap_future(future): row for row, future in enumerate(futures)}
    pending = set(rows)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for waiter in sorted(done, key=rows.__getitem__):
            yield rows[waiter], waiter.result()


def _input_error(problems: list[str]) -> ValueError:
    lines = "\n".join(f"  - {p}" for p in problems)
    return ValueError(f"Invalid generation input:\n{lines}")


def _input_ids_problems(input_ids: Any, vocab_size: int | None) -> list[str]:
    if not isinstance(input_ids, torch.Tensor):
        return ["input_ids: missing or not a torch.Tensor; expected [B, L] int64"]
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        return [
            f"input_ids: got {input_ids.dtype} of shape {tuple(input_ids.shape)}; expected a "
            "[B, L] int64 tensor (use .long())"
        ]
    if vocab_size is None or not input_ids.numel():
        return []
    if input_ids.min() < 0 or input_ids.max() >= vocab_size:
        return [f"input_ids: token ids must lie in [0, {vocab_size}) (the model's vocabulary)"]
    return []


def _lengths_problems(lengths: Any, batch: int, width: int) -> list[str]:
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (batch,):
        shape = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths)
        return [f"input_lengths: got {shape}; expected a [{batch}] integer tensor"]
    if lengths.is_floating_point() or lengths.dtype == torch.bool:
        return [f"input_lengths: got {lengths.dtype}; expected an integer tensor"]
    if batch and (lengths.min() < 1 or lengths.max() > width):
        return [f"input_lengths: values must lie in [1, {width}] (input_ids has {width} columns)"]
    return []


def _stop_strings_problems(stop_strings: Any, batch: int) -> list[str]:
    if not isinstance(stop_strings, list) or len(stop_strings) != batch:
        got = f"{len(stop_strings)} entries" if isinstance(stop_strings, list) else "not a list"
        return [f"stop_strings: has {got}, expected one per sample ({batch})"]
    for i, stops in enumerate(stop_strings):
        ok = stops is None or (
            isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
        )
        if not ok:
            return [f"stop_strings[{i}]: {stops!r} must be None or a list of non-empty strings"]
    return []


def _budget_problems(budgets: Any, batch: int) -> list[str]:
    if not isinstance(budgets, torch.Tensor) or budgets.shape != (batch,):
        return [f"max_new_tokens: expected a [{batch}] integer tensor, got {budgets!r}"]
    if budgets.is_floating_point() or budgets.dtype == torch.bool:
        return [f"max_new_tokens: got {budgets.dtype}; expected an integer tensor"]
    if batch and budgets.min() < 0:
        return ["max_new_tokens: per-sample budgets must be >= 0"]
    return []
