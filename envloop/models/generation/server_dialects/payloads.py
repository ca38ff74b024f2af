"""Pieces of request bodies and answer readers that several dialects share."""

from __future__ import annotations

import math
from typing import Any

from envloop.models.generation.server_dialects.interfaces import (
    Finish,
    MalformedReply,
    Reply,
    Sampling,
)


def openai_sampling(sampling: Sampling, top_k_off: int) -> dict[str, Any]:
    """The sampling fields of a vLLM or SGLang body, every other knob neutral; ``top_k_off``
    is the server's value for "no top-k".

    >>> openai_sampling(Sampling(0.7, 0.9, None, greedy=False), top_k_off=-1)["top_k"]
    -1
    """
    neutral = {
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    if sampling.greedy:
        return {**neutral, "temperature": 0.0, "top_p": 1.0, "top_k": top_k_off}
    return {
        **neutral,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k is not None else top_k_off,
    }


def listed_answers(payload: Any, n: int, asked: str) -> list[Any]:
    """``payload`` if it is a list of ``n`` answers; else :class:`MalformedReply` saying
    what was ``asked`` and what came.

    >>> listed_answers([{}, {}], 2, "asked for 2 completions")
    [{}, {}]
    """
    if not isinstance(payload, list) or len(payload) != n:
        got = f"{len(payload)} answers" if isinstance(payload, list) else "one answer"
        raise MalformedReply(f"{asked}, got {got}")
    return payload


def count(value: Any) -> int | None:
    """``value`` if it is an int (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def checked_reply(tokens: Any, logprobs: list[Any], finish: Finish) -> Reply:
    """A :class:`Reply` of integer ``tokens`` with one number in ``logprobs`` each; raises
    :class:`MalformedReply` otherwise."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise MalformedReply("token ids must be integers")
    if len(logprobs) != len(tokens):
        raise MalformedReply(f"{len(tokens)} token ids but {len(logprobs)} log-probabilities")
    values = []
    for value in logprobs:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise MalformedReply(f"log-probability {value!r} is not a number")
        values.append(float(value))
    return Reply(list(tokens), list(values), finish)


def field(payload: Any, key: str, kind: type) -> Any:
    """``payload[key]``, which must be a ``kind``; raises :class:`MalformedReply` otherwise."""
    value = payload.get(key) if isinstance(payload, dict) else None
    if not isinstance(value, kind):
        raise MalformedReply(f"{key!r} missing or not a {kind.__name__}")
    return value


def first(items: list[Any], key: str) -> Any:
    """The first of ``items`` (the field ``key``); raises :class:`MalformedReply` if empty."""
    if not items:
        raise MalformedReply(f"{key!r} is empty")
    return items[0]
