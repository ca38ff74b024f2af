"""Per-sample pieces of a turn, shared by the batched and the asynchronous engines.

Each function handles one concern of the turn loop (docs/contract.md, "Rollout semantics")
for one sample (or for one turn's worth of responses split into per-sample pieces), so that
any engine can compose them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.multimodal_utils import text_tokenizer
from envloop.data.tokenization import decode_texts
from envloop.distributed.batched_data_dict import BatchedDataDict


@dataclass
class Responses:
    """One turn's responses for b samples, split per sample.

    Attributes:
        token_ids: b tensors [n_j] int64, the generated tokens (EOS kept).
        logprobs: b tensors [n_j] float32.
        texts: b decoded responses (a final EOS dropped).
        counts: [b] int64, n_j.
        flat_ids: [sum n_j] int64, all responses' tokens concatenated.
        ended_with_eos: b flags, True when the response's last token is EOS.
        versions: b tensors [n_j] int32, the policy version of each token (0 where the
            policy reports none).
        min_versions: [b] int64, each response's oldest token version (-1 for an empty
            response).
        max_versions: [b] int64, each response's newest token version (-1 if empty).
        errors: b entries, the ``generation_error`` of each row (None: it generated).
    """

    token_ids: list[torch.Tensor]
    logprobs: list[torch.Tensor]
    texts: list[str]
    counts: torch.Tensor
    flat_ids: torch.Tensor
    ended_with_eos: list[bool]
    versions: list[torch.Tensor]
    min_versions: torch.Tensor
    max_versions: torch.Tensor
    errors: list[Any]


def split_responses(
    output: BatchedDataDict[Any],
    input_lengths: torch.Tensor,
    budgets: torch.Tensor | None,
    tokenizer: Any,
) -> Responses:
    """Cut each row's generated tokens out of a ``GenerationOutputSpec`` batch.

    A response longer than its budget (a policy that ignored ``max_new_tokens``) is cut to
    the budget, so no sample ever grows past ``max_seq_len``. A row with a
    ``generation_error`` has no response (whatever tokens it holds are dropped).
    """
    out_ids = output["output_ids"]
    errors = output.get("generation_error") or [None] * out_ids.shape[0]
    counts = _response_counts(
        output["generation_lengths"].long().numpy(),
        None if budgets is None else budgets.long().numpy(),
        errors,
    )
    positions = torch.arange(out_ids.shape[1])
    start = input_lengths.long()[:, None]
    mask = (positions >= start) & (positions < start + counts[:, None])
    versions = output.get("policy_versions")
    flat_versions = None if versions is None else versions[mask]
    generated = _Generated(
        out_ids[mask].long(), output["logprobs"][mask].float(), flat_versions, counts
    )
    return _split_generated(generated, errors, tokenizer)


def split_response_rows(
    outputs: Sequence[BatchedDataDict[Any]],
    input_lengths: Sequence[int],
    budgets: Sequence[int],
    tokenizer: Any,
) -> Responses:
    """:func:`split_responses` of the batch that ``outputs`` (b one-row
    ``GenerationOutputSpec`` batches, each [1, L_k] wide, as ``generate_async`` hands them
    back) would make, without building it: each row's response is cut out of its output
    and the responses are laid end to end, as :func:`split_responses` lays them.
    ``input_lengths`` and ``budgets`` give each row's prompt length and token budget."""
    errors = [_row_error(output) for output in outputs]
    lengths = torch.cat([output["generation_lengths"] for output in outputs]).long().numpy()
    counts = _response_counts(lengths, np.asarray(budgets, dtype=np.int64), errors)
    widths = np.array([output["output_ids"].shape[1] for output in outputs], dtype=np.int64)
    prompts, n = np.asarray(input_lengths, dtype=np.int64), counts.numpy()
    if (prompts + n > widths).any():
        raise ValueError(
            "The policy's generate_async() handed back a row whose generation_lengths "
            "counts more tokens than its output_ids hold after the prompt."
        )

    def laid_out(key: str, dtype: type) -> torch.Tensor:
        rows = [_row_values(_row_column(output, key)) for output in outputs]
        pieces = [row[start : start + k] for row, start, k in zip(rows, prompts, n)]
        return torch.from_numpy(np.concatenate(pieces).astype(dtype, copy=False))

    has_versions = any(output.get("policy_versions") is not None for output in outputs)
    flat_versions = laid_out("policy_versions", np.int32) if has_versions else None
    generated = _Generated(
        laid_out("output_ids", np.int64), laid_out("logprobs", np.float32), flat_versions, counts
    )
    return _split_generated(generated, errors, tokenizer)


def _row_values(column: torch.Tensor) -> np.ndarray:
    """The one row of ``column`` ([1, L]) as a numpy array (a view where numpy can read
    the tensor: a µs, where torch's own conversions cost several)."""
    try:
        return column.numpy()[0]
    except (TypeError, RuntimeError):  # on a GPU, in autograd, or bfloat16
        column = column.detach().cpu()
        return (column.float() if column.is_floating_point() else column).numpy()[0]


def _row_column(output: BatchedDataDict[Any], key: str) -> torch.Tensor:
    """``output[key]`` ([1, L]); a row without ``policy_versions`` holds version 0, as
    ``build_output`` writes."""
    if key == "policy_versions" and output.get(key) is None:
        return torch.zeros(output["output_ids"].shape, dtype=torch.int32)
    return output[key]


@dataclass
class _Generated:
    """b responses' tokens laid end to end: ids [N] int64, logprobs [N] float32, versions
    [N] (None: the policy reports none) and counts [b] int64 (N = their sum)."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor | None
    counts: torch.Tensor


def _response_counts(
    lengths: np.ndarray, budgets: np.ndarray | None, errors: list[Any]
) -> torch.Tensor:
    """[b] int64: each row's generated tokens (``lengths``), cut to its budget; 0 for a
    failed row."""
    counts = lengths.copy() if budgets is None else np.minimum(lengths, budgets)
    counts[np.array([e is not None for e in errors], dtype=bool)] = 0
    return torch.from_numpy(counts)


def _split_generated(generated: _Generated, errors: list[Any], tokenizer: Any) -> Responses:
    flat_ids, counts = generated.ids, generated.counts
    versions = generated.versions
    versions = (
        torch.zeros(len(flat_ids), dtype=torch.int32)
        if versions is None
        else versions.to(torch.int32)
    )
    count_list = counts.tolist()
    token_lists = _split_list(flat_ids.tolist(), count_list)
    tokenizer = text_tokenizer(tokenizer)
    eos_id = tokenizer.eos_token_id
    ended = [bool(ids) and ids[-1] == eos_id for ids in token_lists]
    to_decode = [ids[:-1] if e else ids for ids, e in zip(token_lists, ended)]
    low, high = _version_spans(versions, counts)
    return Responses(
        token_ids=split_owned(flat_ids, count_list),
        logprobs=split_owned(generated.logprobs, count_list),
        texts=decode_texts(tokenizer, to_decode),
        counts=counts,
        flat_ids=flat_ids,
        ended_with_eos=ended,
        versions=split_owned(versions, count_list),
        min_versions=low,
        max_versions=high,
        errors=errors,
    )


def _version_spans(
    versions: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each response's oldest and newest token version ([b] int64 each, -1 for an empty
    response), from every response's token versions laid end to end ([N] int32)."""
    n = counts.numpy()
    low = np.full(len(n), -1, dtype=np.int64)
    high = np.full(len(n), -1, dtype=np.int64)
    nonempty = n > 0
    if nonempty.any():
        starts = (np.cumsum(n) - n)[nonempty]
        values = versions.numpy()
        low[nonempty] = np.minimum.reduceat(values, starts)
        high[nonempty] = np.maximum.reduceat(values, starts)
    return torch.from_numpy(low), torch.from_numpy(high)


def _row_error(output: BatchedDataDict[Any]) -> Any:
    """The ``generation_error`` of a one-row output (None when it has none)."""
    errors = output.get("generation_error")
    return errors[0] if errors else None


def check_generation_output(output: Any, num_prompts: int) -> None:
    """Raise a clear error when a policy's output does not fit ``GenerationOutputSpec``."""
    missing = [k for k in ("output_ids", "generation_lengths", "logprobs") if k not in output]
    if missing:
        raise ValueError(f"The policy's generate() output lacks {missing} (GenerationOutputSpec).")
    for key in ("output_ids", "generation_lengths", "logprobs"):
        rows = output[key].shape[0]
        if rows != num_prompts:
            raise ValueError(
                f"The policy's generate() returned {rows} rows of {key!r} for {num_prompts} "
                "prompts; it must return one row per prompt, in input order."
            )


def assistant_message(
    text: str,
    token_ids: torch.Tensor,
    logprobs: torch.Tensor | None,
    versions: torch.Tensor | None = None,
) -> dict:
    """The message appended to a log for one generated response: ``token_ids`` [n],
    ``generation_logprobs`` [n] float32 and ``generation_policy_versions`` [n] int32 (each
    token's policy version), the last two when given."""
    message = {"role": "assistant", "content": text, "token_ids": token_ids}
    if logprobs is not None:
        message["generation_logprobs"] = logprobs
    if versions is not None:
        message["generation_policy_versions"] = versions
    return message


def observation_text(
    observation: Mapping[str, Any], renderer: ObservationRenderer | None, ended_with_eos: bool
) -> str:
    """What gets tokenized for an observation: raw content, or its chat-template rendering."""
    if renderer is None:
        return observation["content"]
    return renderer.render(observation["role"], observation["content"], ended_with_eos)


def cut_content(rendered: str, content: str, kept_text: str) -> str:
    """The content of an observation cut to its first tokens: the part of ``kept_text`` (the
    kept tokens decoded) that falls on ``content`` within ``rendered`` (what was tokenized:
    the content itself, or its chat-template rendering), so the chat template's markup never
    becomes message content. A template that does not carry the content verbatim gives the
    kept text as it is.

    >>> cut_content("<e><user>hello world<e><assistant>", "hello world", "<e><user>hello")
    'hello'
    >>> cut_content("<e><user>hello world<e><assistant>", "hello world", "<e><us")
    ''
    >>> cut_content("raw text", "raw text", "raw")
    'raw'
    """
    start = rendered.find(content) if content else -1
    if start < 0:
        return kept_text
    return kept_text[start : start + len(content)]


def fit_observation(token_ids: list[int], length: int, max_seq_len: int) -> tuple[list[int], bool]:
    """The observation tokens that fit after ``length`` tokens, and whether it was truncated.

    A sample is truncated when prompt + response + observation would reach ``max_seq_len``.

    >>> fit_observation([1, 2, 3], length=5, max_seq_len=10)
    ([1, 2, 3], False)
    >>> fit_observation([1, 2, 3], length=7, max_seq_len=10)
    ([1, 2, 3], True)
    >>> fit_observation([1, 2, 3], length=8, max_seq_len=10)
    ([1, 2], True)
    """
    truncated = length + len(token_ids) >= max_seq_len
    return token_ids[: max_seq_len - length], truncated


def split_owned(flat: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``flat`` cut into pieces of ``counts``, each with its own storage.

    (A view would drag the whole batch's storage along whenever one message is pickled.)
    """
    values = flat.detach().cpu().numpy()
    ends = np.cumsum(counts)
    # Copied through numpy: a few µs a piece, where torch's clone costs tens.
    return [torch.from_numpy(values[end - n : end].copy()) for n, end in zip(counts, ends)]


def _split_list(flat: list[int], counts: list[int]) -> list[list[int]]:
    out, offset = [], 0
    for n in counts:
        out.append(flat[offset : offset + n])
        offset += n
    return out
