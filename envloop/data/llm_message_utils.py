"""Flatten, pad, mask and chat-template message logs (SPEC §4)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from envloop.data.chat_templates import render_chat
from envloop.data.interfaces import FlatMessagesType, LLMMessageLogType
from envloop.data.tokenization import tokenize_texts
from envloop.distributed.batched_data_dict import BatchedDataDict


def get_keys_from_message_log(
    message_log: LLMMessageLogType, keys: Iterable[str]
) -> LLMMessageLogType:
    """Each message reduced to ``keys`` (keys a message lacks are skipped).

    >>> get_keys_from_message_log([{"role": "user", "content": "hi", "x": 1}], ["role", "content"])
    [{'role': 'user', 'content': 'hi'}]
    """
    wanted = list(keys)
    return [{k: message[k] for k in wanted if k in message} for message in message_log]


def message_log_to_flat_messages(message_log: LLMMessageLogType) -> FlatMessagesType:
    """Per key, the messages' tensors concatenated (1-D) and other values listed.

    Per-token tensors stay aligned with ``token_ids``: a message that has ``token_ids`` but
    lacks another tensor key (e.g. a prompt has no ``generation_logprobs``) contributes zeros.

    >>> log = [
    ...     {"role": "user", "content": "a", "token_ids": torch.tensor([1, 2])},
    ...     {"role": "assistant", "content": "b", "token_ids": torch.tensor([3]),
    ...      "generation_logprobs": torch.tensor([-0.5])},
    ... ]
    >>> flat = message_log_to_flat_messages(log)
    >>> flat["token_ids"].tolist(), flat["generation_logprobs"].tolist(), flat["content"]
    ([1, 2, 3], [0.0, 0.0, -0.5], ['a', 'b'])
    """
    tensor_keys: dict[str, torch.dtype] = {}
    for message in message_log:
        for key, value in message.items():
            if isinstance(value, torch.Tensor):
                tensor_keys.setdefault(key, value.dtype)
    flat: FlatMessagesType = {}
    for key, dtype in tensor_keys.items():
        parts = [_per_token_part(message, key, dtype) for message in message_log]
        flat[key] = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
    for message in message_log:
        for key, value in message.items():
            if key not in tensor_keys:
                flat.setdefault(key, []).append(value)  # type: ignore[union-attr]
    return flat


def batched_message_log_to_flat_message(
    message_log_batch: Sequence[LLMMessageLogType],
    pad_value_dict: Mapping[str, int | float] | None = None,
    make_sequence_length_divisible_by: int = 1,
) -> tuple[BatchedDataDict[Any], torch.Tensor]:
    """Flatten every log and right-pad its tensors to one length.

    Returns ``(flat, input_lengths)``: ``flat[key]`` is [B, L] for tensor keys (padded with
    ``pad_value_dict[key]``, default 0; L rounded up to a multiple of
    ``make_sequence_length_divisible_by``) and a list of per-sample lists otherwise;
    ``input_lengths`` is [B] int32, the unpadded ``token_ids`` lengths. Every tensor key has
    the same L and stays aligned with ``token_ids``: a sample's tokens whose messages lack
    the key hold 0.

    >>> logs = [[{"role": "user", "content": "a", "token_ids": torch.tensor([1, 2, 3])}],
    ...         [{"role": "user", "content": "b", "token_ids": torch.tensor([4])}]]
    >>> flat, lengths = batched_message_log_to_flat_message(logs, {"token_ids": 0}, 4)
    >>> flat["token_ids"].tolist(), lengths.tolist()
    ([[1, 2, 3, 0], [4, 0, 0, 0]], [3, 1])
    """
    if make_sequence_length_divisible_by < 1:
        raise ValueError(
            "make_sequence_length_divisible_by must be >= 1, got "
            f"{make_sequence_length_divisible_by}."
        )
    for i, log in enumerate(message_log_batch):
        require_token_ids(log, sample_index=i)
    flats = [message_log_to_flat_messages(log) for log in message_log_batch]
    if not flats:
        return BatchedDataDict(), torch.empty(0, dtype=torch.int32)
    lengths = torch.tensor([len(f.get("token_ids", ())) for f in flats], dtype=torch.int32)
    pad_values = dict(pad_value_dict or {})
    # One width for every tensor key, so per-token columns stay aligned with token_ids.
    width = max(
        (len(v) for f in flats for v in f.values() if isinstance(v, torch.Tensor)), default=0
    )
    width = -(-width // make_sequence_length_divisible_by) * make_sequence_length_divisible_by
    out: BatchedDataDict[Any] = BatchedDataDict()
    for key in _union_keys(flats):
        values = [f.get(key) for f in flats]
        if any(isinstance(v, torch.Tensor) for v in values):
            out[key] = _pad_rows(values, lengths.tolist(), pad_values.get(key, 0), width)
        else:
            out[key] = [v if v is not None else [] for v in values]
    return out, lengths


def add_loss_mask_to_message_log(
    message_log_batch: Sequence[LLMMessageLogType],
    roles_to_train_on: Sequence[str] = ("assistant",),
    only_unmask_final: bool = False,
) -> None:
    """Add ``token_loss_mask`` ([T] bool) to every message, in place.

    A message is trained on (all True) when its role is in ``roles_to_train_on`` and, with
    ``only_unmask_final``, it is the last message of its log; otherwise all False.
    """
    roles = set(roles_to_train_on)
    for log in message_log_batch:
        last = len(log) - 1
        for i, message in enumerate(log):
            train = message["role"] in roles and (not only_unmask_final or i == last)
            n = len(message["token_ids"])
            message["token_loss_mask"] = torch.full((n,), train, dtype=torch.bool)


def get_formatted_message_log(
    message_log: LLMMessageLogType,
    tokenizer: Any,
    add_bos_token: bool = True,
    add_eos_token: bool = True,
    add_generation_prompt: bool = False,
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
    """
    texts: list[str] = []
    for i in range(len(message_log)):
        prompt = add_generation_prompt and i == len(message_log) - 1
        texts.append(render_chat(tokenizer, message_log[: i + 1], add_generation_prompt=prompt))
    deltas = _prefix_deltas(texts)
    token_lists = tokenize_texts(tokenizer, deltas)
    _add_bos_eos(token_lists, tokenizer, add_bos_token, add_eos_token and not add_generation_prompt)
    return [
        {**message, "token_ids": torch.tensor(ids, dtype=torch.long)}
        for message, ids in zip(message_log, token_lists)
    ]


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


def _per_token_part(message: Mapping[str, Any], key: str, dtype: torch.dtype) -> torch.Tensor:
    value = message.get(key)
    if isinstance(value, torch.Tensor):
        return value
    n = len(message["token_ids"]) if "token_ids" in message else 0
    return torch.zeros(n, dtype=dtype)


def _union_keys(flats: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    return list(keys)


def _pad_rows(
    rows: list[Any], lengths: list[int], pad_value: int | float, width: int
) -> torch.Tensor:
    # A sample whose messages all lack the key gets zeros over its tokens, as a single
    # message lacking it does in message_log_to_flat_messages.
    dtype = next(r.dtype for r in rows if isinstance(r, torch.Tensor))
    tensors = [
        r if isinstance(r, torch.Tensor) else torch.zeros(n, dtype=dtype)
        for r, n in zip(rows, lengths)
    ]
    out = torch.full((len(tensors), width), pad_value, dtype=dtype)
    for i, t in enumerate(tensors):
        out[i, : len(t)] = t
    return out


def _prefix_deltas(texts: list[str]) -> list[str]:
    deltas, previous = [], ""
    for i, text in enumerate(texts):
        if not text.startswith(previous):
            raise ValueError(
                f"The chat template renders messages[:{i}] as text that is not a prefix of its "
                f"rendering of messages[:{i + 1}], so per-message token_ids cannot be exact. "
                "This happens with templates that rewrite earlier turns (e.g. strip reasoning); "
                "tokenize such logs as one message instead."
            )
        deltas.append(text[len(previous) :])
        previous = text
    return deltas


def _add_bos_eos(token_lists: list[list[int]], tokenizer: Any, bos: bool, eos: bool) -> None:
    if not token_lists:
        return
    bos_id, eos_id = getattr(tokenizer, "bos_token_id", None), tokenizer.eos_token_id
    if bos and bos_id is not None and token_lists[0][:1] != [bos_id]:
        token_lists[0].insert(0, bos_id)
    if eos and eos_id is not None and eos_id not in token_lists[-1]:
        token_lists[-1].append(eos_id)
