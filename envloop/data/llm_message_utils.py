"""Flatten, pad, mask and chat-template message logs (docs/contract.md, "Message utilities")."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from envloop.data.interfaces import FlatMessagesType, LLMMessageLogType, TaskDataSpec
from envloop.data.message_tokens import message_token_ids
from envloop.data.multimodal_messages import format_with_processor
from envloop.data.multimodal_utils import PackedTensor, is_processor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.packed_tensor import common_dim_to_pack


def get_keys_from_message_log(
    message_log: LLMMessageLogType, keys: Iterable[str]
) -> LLMMessageLogType:
    """Each message reduced to ``keys`` (keys a message lacks are skipped).

    >>> get_keys_from_message_log([{"role": "user", "content": "hi", "x": 1}], ["role", "content"])
    [{'role': 'user', 'content': 'hi'}]
    """
    wanted = list(keys)
    return [{k: message[k] for k in wanted if k in message} for message in message_log]


def message_log_to_flat_messages(
    message_log: LLMMessageLogType, *, deduplicate_multimodal_data: bool = False
) -> FlatMessagesType:
    """Per key, the messages' tensors concatenated along dim 0 and other values listed.

    Per-token tensors stay aligned with ``token_ids``: a message that has ``token_ids`` but
    lacks another tensor key (e.g. a prompt has no ``generation_logprobs``) contributes zeros
    ([T, *trailing] of the key's dtype). Messages without ``token_ids`` contribute nothing to
    keys they lack. A key's tensors must agree in dtype, device, rank and trailing shape
    (``RuntimeError`` naming the key otherwise).

    A key whose values are ``PackedTensor`` (a message's vision inputs, e.g.
    ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3]) becomes a one-row
    ``PackedTensor`` referencing the tensors of every message holding the key, in message
    order (the log's images in the order the model sees their placeholders); reading the
    row (``p[0]``, ``as_tensor()``) concatenates them along ``dim_to_pack``. Nothing is
    copied, so images shared by several logs stay stored once when the logs are batched.
    Messages without the key contribute nothing (vision inputs are not per-token, so
    nothing is zero-filled). A key that is a ``PackedTensor`` in one message must be one
    in every message holding it (``TypeError`` naming the key otherwise).
    ``deduplicate_multimodal_data`` gives the values provenance (on copies) first.

    >>> log = [
    ...     {"role": "user", "content": "a", "token_ids": torch.tensor([1, 2])},
    ...     {"role": "assistant", "content": "b", "token_ids": torch.tensor([3]),
    ...      "generation_logprobs": torch.tensor([-0.5])},
    ... ]
    >>> flat = message_log_to_flat_messages(log)
    >>> flat["token_ids"].tolist(), flat["generation_logprobs"].tolist(), flat["content"]
    ([1, 2, 3], [0.0, 0.0, -0.5], ['a', 'b'])
    >>> log[0]["pixel_values"] = PackedTensor([torch.ones(4, 6)], dim_to_pack=0)
    >>> log[1]["pixel_values"] = PackedTensor([torch.zeros(2, 6)], dim_to_pack=0)
    >>> pixels = message_log_to_flat_messages(log)["pixel_values"]
    >>> len(pixels), tuple(pixels[0].shape)
    (1, (6, 6))
    """
    templates: dict[str, torch.Tensor] = {}
    packed_keys: dict[str, None] = {}
    for message in message_log:
        for key, value in message.items():
            if isinstance(value, torch.Tensor):
                templates.setdefault(key, value)
            elif isinstance(value, PackedTensor):
                packed_keys[key] = None
    _check_packed_keys_hold_only_packed(message_log, packed_keys)
    flat: FlatMessagesType = {}
    for key, template in templates.items():
        parts = [_per_token_part(message, key, template) for message in message_log]
        flat[key] = _concat_parts(key, [p for p in parts if p is not None])
    for key in packed_keys:
        values = [m[key] for m in message_log if key in m]
        if deduplicate_multimodal_data:
            values = [_deduplicated(v) for v in values]
        flat[key] = _packed_log_item(key, values)
    for message in message_log:
        for key, value in message.items():
            if key not in templates and key not in packed_keys:
                flat.setdefault(key, []).append(value)  # type: ignore[union-attr]
    return flat


def batched_message_log_to_flat_message(
    message_log_batch: Sequence[LLMMessageLogType],
    pad_value_dict: Mapping[str, int | float] | None = None,
    make_sequence_length_divisible_by: int = 1,
    *,
    deduplicate_multimodal_data: bool = False,
) -> tuple[BatchedDataDict[Any], torch.Tensor]:
    """Flatten every log (``message_log_to_flat_messages``) and right-pad its tensors.

    Returns ``(flat, input_lengths)``. Every tensor key present in any message becomes
    [B, L, *trailing] (e.g. ``token_ids`` [B, L], a per-token [T, K] tensor [B, L, K]),
    keeping its dtype and device, padded with ``pad_value_dict[key]`` (default 0); all tensor
    keys share L, the longest flattened tensor rounded up to a multiple of
    ``make_sequence_length_divisible_by``. A sample with no tensor for a key gets an all-pad
    row. ``input_lengths`` is [B] int32: per sample, its longest flattened tensor (its
    ``token_ids`` length for tokenized logs). ``PackedTensor`` keys (vision inputs) become
    one ``PackedTensor`` with one row per sample: that sample's tensors of every message
    (no tensor for a sample without the key); they do not count towards ``input_lengths``
    or L. It stores each tensor once however many samples (the generations of a prompt)
    and messages reference it (docs/multimodal_data.md). A batch mixing deduplicated values
    (``PackedTensor.enable_deduplication``) with a sample whose plain values are several
    rows raises ``MisalignedMediaError`` (an ``AssertionError`` and ``ValueError``), as
    the published interface does; ``deduplicate_multimodal_data`` treats every value as
    deduplicated. Other keys become per-sample lists of the
    messages' values (``[]`` for a sample without the key). A batch with no tensors at all
    maps each key to each sample's first value (None if absent) with empty
    ``input_lengths``, as the published interface does; an empty batch gives an empty
    result. Logs need no ``token_ids`` (the rollout engine checks its own input with
    ``require_token_ids``). Inconsistent tensors raise ``RuntimeError`` naming the key.

    >>> logs = [[{"role": "user", "content": "a", "token_ids": torch.tensor([1, 2, 3])}],
    ...         [{"role": "user", "content": "b", "token_ids": torch.tensor([4])}]]
    >>> flat, lengths = batched_message_log_to_flat_message(logs, {"token_ids": 0}, 4)
    >>> flat["token_ids"].tolist(), lengths.tolist(), flat["role"]
    ([[1, 2, 3, 0], [4, 0, 0, 0]], [3, 1], [['user'], ['user']])
    >>> logs[1][0]["pixel_values"] = PackedTensor([torch.ones(4, 6)], dim_to_pack=0)
    >>> flat, lengths = batched_message_log_to_flat_message(logs)
    >>> flat["pixel_values"], lengths.tolist()
    (PackedTensor(2 items [None, (4, 6)], dim_to_pack=0), [3, 1])
    """
    if make_sequence_length_divisible_by < 1:
        raise ValueError(
            "make_sequence_length_divisible_by must be >= 1, got "
            f"{make_sequence_length_divisible_by}."
        )
    flats = [
        message_log_to_flat_messages(log, deduplicate_multimodal_data=deduplicate_multimodal_data)
        for log in message_log_batch
    ]
    if not flats:
        return BatchedDataDict(), torch.empty(0, dtype=torch.int32)
    keys = _union_keys(flats)
    packed = {
        k: _packed_batch(
            k,
            [f.get(k) for f in flats],
            *_raw_media(message_log_batch, k, deduplicate_multimodal_data),
        )
        for k in keys
        if any(isinstance(f.get(k), PackedTensor) for f in flats)
    }
    keys = [k for k in keys if k not in packed]
    tensor_keys = [k for k in keys if any(isinstance(f.get(k), torch.Tensor) for f in flats)]
    if not tensor_keys:
        first_values = {k: [f[k][0] if k in f else None for f in flats] for k in keys}
        return BatchedDataDict({**first_values, **packed}), torch.empty(0, dtype=torch.int32)
    lengths = [max((len(f[k]) for k in tensor_keys if k in f), default=0) for f in flats]
    step = make_sequence_length_divisible_by
    width = -(-max(lengths) // step) * step
    pad_values = dict(pad_value_dict or {})
    out: BatchedDataDict[Any] = BatchedDataDict()
    for key in keys:
        values = [f.get(key) for f in flats]
        if key in tensor_keys:
            out[key] = _pad_rows(key, values, pad_values.get(key, 0), width)
        else:
            out[key] = [v if v is not None else [] for v in values]
    out.update(packed)
    return out, torch.tensor(lengths, dtype=torch.int32)


def add_loss_mask_to_message_log(
    message_log_batch: Sequence[LLMMessageLogType],
    roles_to_train_on: Sequence[str] = ("assistant",),
    only_unmask_final: bool = False,
) -> None:
    """Add ``token_loss_mask`` ([T] bool) to every message, in place.

    A message is trained on (all True) when its role is in ``roles_to_train_on`` (compared
    case-insensitively) and, with ``only_unmask_final``, it is the last message of its log;
    otherwise all False. (The published version unmasks the last message whatever its role
    under ``only_unmask_final``; here its role must still be one to train on.)

    >>> log = [{"role": "user", "token_ids": torch.tensor([1, 2])},
    ...        {"role": "Assistant", "token_ids": torch.tensor([3])}]
    >>> add_loss_mask_to_message_log([log], roles_to_train_on=["assistant"])
    >>> [m["token_loss_mask"].tolist() for m in log]
    [[False, False], [True]]
    """
    roles = {role.lower() for role in roles_to_train_on}
    for log in message_log_batch:
        last = len(log) - 1
        for i, message in enumerate(log):
            role = str(message["role"]).lower()
            train = role in roles and (not only_unmask_final or i == last)
            n = len(message["token_ids"])
            message["token_loss_mask"] = torch.full((n,), train, dtype=torch.bool)


def get_formatted_message_log(
    message_log: LLMMessageLogType,
    tokenizer: Any,
    task_data_spec: TaskDataSpec | None = None,
    add_bos_token: bool = True,
    add_eos_token: bool = True,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    debug: bool = False,
) -> LLMMessageLogType:
    """Apply the tokenizer's chat template message by message.

    Each returned message keeps its keys (``content`` stays the message's own text, which is
    what environments see) and gains ``token_ids``: its part of the templated conversation,
    such that concatenating ``token_ids`` over the log equals tokenizing the whole templated
    conversation (``tokenizer.apply_chat_template(log, tokenize=True)``).
    With ``add_generation_prompt`` the assistant prefix is part of the last message.
    ``add_bos_token`` prepends BOS to the first message when the template did not;
    ``add_eos_token`` appends EOS to the last message when its tokens hold no EOS and no
    generation prompt follows. The template must render each prefix of the conversation
    as a prefix of the next rendering (true of ChatML, Llama 3 and most templates).

    ``tokenizer`` may be a multimodal processor, and message contents lists of parts
    (``{"type": "text", "text": ...}``, ``{"type": "image", "image": ...}``): messages with
    images then carry their image placeholders expanded in ``token_ids`` and their vision
    inputs (e.g. ``pixel_values``, ``image_grid_thw``) as one-item ``PackedTensor`` values,
    and the concatenated ``token_ids`` equal ``processor.apply_chat_template(log,
    tokenize=True)`` (see ``envloop.data.multimodal_utils``).

    ``task_data_spec`` (third, as in the published signature): its ``prompt``, a format
    string, is applied to the first user message's content (``prompt.format(content)``)
    before templating; the returned message carries the formatted content. ``tools`` is
    passed to the chat template; ``debug`` prints each message's templated chunk.
    """
    if isinstance(task_data_spec, bool):
        raise TypeError(
            "get_formatted_message_log's third parameter is task_data_spec (a TaskDataSpec or "
            "None); pass add_bos_token and the other flags by keyword."
        )
    if is_processor(tokenizer):
        return format_with_processor(
            message_log, tokenizer, task_data_spec, add_bos_token, add_eos_token,
            add_generation_prompt, tools, debug,
        )  # fmt: skip
    log, token_lists = message_token_ids(
        message_log, tokenizer, task_data_spec, add_bos_token, add_eos_token,
        add_generation_prompt, tools, debug,
    )  # fmt: skip
    return [
        {**message, "token_ids": torch.tensor(ids, dtype=torch.long)}
        for message, ids in zip(log, token_lists)
    ]


def get_first_index_that_differs(str1: str, str2: str) -> int:
    """The first index where ``str1`` and ``str2`` differ (the shorter length if one is a
    prefix of the other).

    >>> get_first_index_that_differs("hello", "help"), get_first_index_that_differs("ab", "abc")
    (3, 2)
    """
    for i, (a, b) in enumerate(zip(str1, str2)):
        if a != b:
            return i
    return min(len(str1), len(str2))


def require_token_ids(message_log: LLMMessageLogType, sample_index: int | None = None) -> None:
    """Raise a clear error unless every message carries a 1-D int64 ``token_ids`` tensor."""
    where = f"sample {sample_index}, " if sample_index is not None else ""
    for j, message in enumerate(message_log):
        ids = message.get("token_ids")
        if ids is None:
            raise ValueError(
                f"{where}message {j} (role {message.get('role')!r}) has no 'token_ids'. "
                "Tokenize prompts first, e.g. with get_formatted_message_log(log, tokenizer)."
            )
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.long:
            desc = (
                f"a {tuple(ids.shape)} {ids.dtype} tensor"
                if isinstance(ids, torch.Tensor)
                else type(ids).__name__
            )
            raise ValueError(
                f"{where}message {j}: 'token_ids' must be a 1-D int64 tensor, got {desc}. "
                "Use torch.tensor(ids, dtype=torch.long)."
            )


def _per_token_part(
    message: Mapping[str, Any], key: str, template: torch.Tensor
) -> torch.Tensor | None:
    """The message's tensor for ``key``; zeros over its tokens if it lacks one; else None."""
    value = message.get(key)
    if isinstance(value, torch.Tensor):
        return value
    ids = message.get("token_ids")
    if not isinstance(ids, torch.Tensor) or template.dim() == 0:
        return None
    shape = (len(ids), *template.shape[1:])
    return torch.zeros(shape, dtype=template.dtype, device=template.device)


def _check_packed_keys_hold_only_packed(
    message_log: LLMMessageLogType, packed_keys: Mapping[str, None]
) -> None:
    for j, message in enumerate(message_log):
        for key in packed_keys:
            if key in message and not isinstance(message[key], PackedTensor):
                raise TypeError(
                    f"Packed multimodal key {key!r} also contains non-packed values: "
                    f"[{type(message[key]).__name__!r}] (message {j} of the log; other "
                    f"messages hold PackedTensors). Store {key!r} (a vision input) as a "
                    "PackedTensor in every message that has it, as get_formatted_message_log "
                    "does."
                )


def _packed_log_item(key: str, values: list[PackedTensor]) -> PackedTensor:
    """One row: every message's tensors of ``key``, in order (no tensor if none present).

    The row references the messages' tensors instead of concatenating them: a plain row
    for one tensor (that tensor itself), else a segmented row
    (``PackedTensor.merge_segments`` when any value is deduplicated). Batched, the rows of
    a prompt's generations then share its image's tensors instead of each holding a copy."""
    common_dim_to_pack(values, key)
    _check_packed_consistency(key, values, "in one message log's PackedTensor items")
    if any(v.segmented for v in values):
        return PackedTensor.merge_segments(values)
    dim, padding = values[0].dim_to_pack, values[0].pad_to_max_shape
    present = [t for v in values for t in v.present]
    if len(present) <= 1:
        return PackedTensor(present or [None], dim, pad_to_max_shape=padding)
    refs = list(range(len(present)))
    return PackedTensor(
        present, dim, pad_to_max_shape=padding, _row_offsets=[0, len(refs)], _segment_indices=refs
    )


def _packed_batch(
    key: str, values: list[Any], deduplicated: list[int], plain_rows: list[int | None]
) -> PackedTensor:
    """Per-sample one-row PackedTensors joined; empty rows for samples without ``key``.

    ``deduplicated``: the samples whose messages hold deduplicated values of ``key``;
    ``plain_rows``: per sample, the rows of its messages' plain values of ``key`` (None for
    a deduplicated sample or one without the key)."""
    others = [i for i, v in enumerate(values) if v is not None and not isinstance(v, PackedTensor)]
    if others:
        names = [type(values[i]).__name__ for i in others]
        raise TypeError(
            f"Packed multimodal key {key!r} also contains non-packed values: {names} "
            f"(samples {others}; other samples hold PackedTensors). Store {key!r} as a "
            "PackedTensor in every message that has it."
        )
    packed = [v for v in values if v is not None]
    common_dim_to_pack(packed, key)
    misaligned = [(i, n) for i, n in enumerate(plain_rows) if n is not None and n != 1]
    if deduplicated and misaligned:
        i, n = misaligned[0]
        raise MisalignedMediaError(
            f"flattened_concat requires one logical row per input: {key!r} is deduplicated "
            f"in samples {deduplicated}, but sample {i} holds it as {n} plain rows (one per "
            "message or image), which deduplicated rows cannot be aligned with. Enable "
            f"deduplication on every message's {key!r} (PackedTensor.enable_deduplication(), "
            "or BatchedDataDict.repeat_interleave(..., share_immutable_media=True)) so each "
            "conversation's media is one row."
        )
    _check_packed_consistency(key, packed, "across the batch")
    return PackedTensor.flattened_concat(values)


def _check_packed_consistency(key: str, values: Sequence[PackedTensor], where: str) -> None:
    """``RuntimeError`` unless the stored tensors of ``values`` agree in dtype, device,
    rank and shape apart from the packing dimension (only dtype and device when they are
    padded to the largest shape, ``pad_to_max_shape``)."""
    tensors = [(t, v.dim_to_pack) for v in values for t in v.tensors if t is not None]
    if any(v.pad_to_max_shape for v in values):
        # only dtype and device must agree: every shape is padded in as_tensor
        _validate_tensor_consistency([t.new_empty(0) for t, _ in tensors], key, where)
        return
    _validate_tensor_consistency([t.movedim(dim, 0) for t, dim in tensors], key, where)


class MisalignedMediaError(ValueError, AssertionError):
    """A batch mixes deduplicated media with conversations whose media is several plain
    rows (a ``ValueError``; also an ``AssertionError``, as the published check was)."""


def _deduplicated(value: PackedTensor) -> PackedTensor:
    """``value`` if deduplication is enabled on it, else a copy (same tensors) with it."""
    return value if value.deduplication_enabled else value.sharing_copy().enable_deduplication()


def _raw_media(
    logs: Sequence[LLMMessageLogType], key: str, deduplicate: bool
) -> tuple[list[int], list[int | None]]:
    """The samples whose messages hold deduplicated (or segmented) ``PackedTensor`` values of
    ``key`` (every sample holding it, with ``deduplicate``), and per sample the rows of its
    plain ones (None for those samples and for samples without the key)."""
    deduplicated: list[int] = []
    plain_rows: list[int | None] = []
    for i, log in enumerate(logs):
        values = [m[key] for m in log if isinstance(m.get(key), PackedTensor)]
        if values and (deduplicate or any(v.segmented for v in values)):
            deduplicated.append(i)
            plain_rows.append(None)
        else:
            plain_rows.append(sum(len(v) for v in values) if values else None)
    return deduplicated, plain_rows


def _concat_parts(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    _validate_tensor_consistency(parts, key, "in one message log")
    if any(p.dim() == 0 for p in parts):
        raise RuntimeError(
            f"tensors for {key=} must be at least 1-D (one entry per token), got a 0-d "
            "tensor; store a per-message scalar as a Python number or a 1-element tensor."
        )
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _validate_tensor_consistency(
    tensors: Sequence[torch.Tensor | None], key: str = "tensors", where: str = ""
) -> None:
    """Raise ``RuntimeError`` (published wording, then the key and the fix) unless the
    tensors (Nones skipped) agree in dtype, device, rank and shape after dim 0."""
    present = [t for t in tensors if t is not None]
    if len({(t.dtype, t.device, t.shape[1:]) for t in present}) <= 1:
        return  # the common case: one pass; rank is part of shape[1:] except for 0-d
    first = present[0]
    if any(t.dtype != first.dtype for t in present):
        raise RuntimeError(
            f"expected consistent types but got: {[t.dtype for t in present]} for {key=} "
            f"{where}. Give every {key!r} tensor one dtype (e.g. .to({first.dtype}))."
        )
    if any(t.device != first.device for t in present):
        raise RuntimeError(
            f"expected tensors on the same device but got: {[t.device for t in present]} for "
            f"{key=} {where}. Move them to one device first (e.g. .to('{first.device}'))."
        )
    if any(t.dim() != first.dim() for t in present):
        raise RuntimeError(
            f"tensors for {key=} must have same number of dimensions: "
            f"{[tuple(t.shape) for t in present]} ({where}). Per-token tensors are [T] or "
            "[T, ...] with the same trailing dims in every message."
        )
    if any(t.shape[1:] != first.shape[1:] for t in present):
        raise RuntimeError(
            f"tensors for {key=} must have the same shape after dim 0: "
            f"{[tuple(t.shape) for t in present]} ({where})."
        )


def _union_keys(flats: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    return list(keys)


def _pad_rows(key: str, rows: list[Any], pad_value: int | float, width: int) -> torch.Tensor:
    """[B, width, *trailing] of ``pad_value`` with each sample's tensor at the start of its row."""
    tensors = [r for r in rows if isinstance(r, torch.Tensor)]
    if len(tensors) != sum(r is not None for r in rows):
        raise RuntimeError(
            f"expected consistent types but {key=} holds a tensor in some samples and another "
            "type in others. Store it as a tensor in every message, or in none."
        )
    _validate_tensor_consistency(tensors, key, "across the batch")
    first = tensors[0]
    empty = first.new_empty((0, *first.shape[1:]))
    filled = [r if r is not None else empty for r in rows]
    # pad_sequence is several times faster than a boolean-mask scatter or a per-row copy.
    padded = torch.nn.utils.rnn.pad_sequence(filled, batch_first=True, padding_value=pad_value)
    if padded.shape[1] == width:
        return padded
    out = torch.full(
        (len(rows), width, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device
    )
    out[:, : padded.shape[1]] = padded
    return out
