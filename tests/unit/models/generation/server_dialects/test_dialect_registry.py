"""The dialect registry: one class per name the config accepts, built with the served
model's name and tokenizer."""

from __future__ import annotations

import typing

from envloop.models.generation.server_config import Dialect
from envloop.models.generation.server_dialects import (
    DIALECTS,
    LlamaCppDialect,
    SglangDialect,
    VllmDialect,
    make_dialect,
)


def test_the_registry_holds_exactly_the_dialects_the_config_accepts():
    assert list(DIALECTS) == list(typing.get_args(Dialect))
    assert {"vllm": VllmDialect, "sglang": SglangDialect, "llamacpp": LlamaCppDialect} == DIALECTS
    assert all(cls.name == name for name, cls in DIALECTS.items())


def test_make_dialect_gives_the_model_name_and_decode_to_the_dialect():
    def decode(ids: list[int]) -> str:
        return ",".join(map(str, ids))

    dialect = make_dialect("llamacpp", "m", decode)
    assert isinstance(dialect, LlamaCppDialect)
    assert (dialect.model, dialect.decode) == ("m", decode)
    assert make_dialect("vllm").model is None
