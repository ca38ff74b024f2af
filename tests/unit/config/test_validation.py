"""validated / config_problems / declared_fields: pydantic-declared configs, envloop's wording."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest
from pydantic import Field
from typing_extensions import TypedDict

from envloop.config.errors import ConfigError
from envloop.config.validation import (
    NonEmptyStr,
    config_problems,
    declared_defaults,
    declared_fields,
    validated,
)


class Limits(TypedDict, total=False):
    cpu_s: Annotated[int, Field(10, ge=1, description="CPU seconds")]


class Options(TypedDict, total=False):
    workers: Annotated[int, Field(2, ge=1, description="worker processes")]
    mode: Annotated[Literal["fast", "exact"], Field("exact", description="how to check")]
    stops: Annotated[list[str] | None, Field(None, description="stop strings")]
    timeout_s: Annotated[float, Field(10.0, gt=0, description="seconds per check")]
    limits: Annotated[Limits | None, Field(None, description="sandbox limits")]
    weights: Annotated[dict[str, float], Field(default_factory=dict)]
    size: Annotated[int | Literal["auto"], Field("auto")]


def test_defaults_are_filled_in_and_given_values_kept():
    assert validated(Options, None) == {
        "workers": 2, "mode": "exact", "stops": None, "timeout_s": 10.0, "limits": None,
        "weights": {}, "size": "auto",
    }  # fmt: skip
    given = {"workers": 3, "timeout_s": 1, "limits": {"cpu_s": 2}, "weights": {"a": 0.5}}
    assert validated(Options, given) == {
        **validated(Options, None), **given, "limits": {"cpu_s": 2},
    }  # fmt: skip


def test_every_problem_is_reported_with_its_dotted_key():
    bad = {
        "workers": 0, "mode": "fats", "stops": ["</a>", 3], "timeout_s": "10",
        "limits": {"cpu_s": 0, "cpu": 1}, "weights": {"a": "x"}, "size": 2.5, "wokers": 1,
    }  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        validated(Options, bad, "the options")
    assert str(raised.value).startswith("Invalid the options:\n  - workers: must be >= 1")
    assert raised.value.problems == [
        "workers: must be >= 1, got 0",
        "mode: 'fats' is not one of fast, exact. Did you mean 'fast'?",
        "stops[1]: expected str, got int (3)",
        "timeout_s: expected number, got str ('10')",
        "limits.cpu_s: must be >= 1, got 0",
        "limits.cpu: unknown option. Did you mean 'cpu_s'?",
        "weights.a: expected number, got str ('x')",
        "size: expected int | 'auto', got float (2.5)",
        "wokers: unknown option. Did you mean 'workers'?",
    ]


def test_validation_is_strict():
    assert config_problems(Options, {"workers": True}) == ["workers: expected int, got bool (True)"]
    assert config_problems(Options, {"workers": "2"}) == ["workers: expected int, got str ('2')"]
    assert config_problems(Options, {"timeout_s": 3}) == []  # an int is a number
    assert config_problems(Options, ["workers"]) == ["expected a mapping, got list (['workers'])"]
    assert config_problems(Options, {"nothing_close": 1}) == [
        "nothing_close: unknown option. Known: workers, mode, stops, timeout_s, limits, "
        "weights, size."
    ]


def test_declarations_are_read_back():
    fields = {f.name: f for f in declared_fields(Options)}
    assert list(fields) == [
        "workers", "mode", "stops", "timeout_s", "limits", "weights", "size",
    ]  # fmt: skip
    assert (fields["workers"].annotation, fields["workers"].default) == (int, 2)
    assert fields["timeout_s"].description == "seconds per check"
    assert fields["weights"].description == "" and not fields["weights"].required
    assert declared_defaults(Limits) == {"cpu_s": 10}
    assert declared_defaults(Options)["weights"] == {}  # from its factory


class Named(TypedDict, total=False):
    name: NonEmptyStr


class Unions(TypedDict, total=False):
    tokenizer: str | dict[str, Any] | None
    label: NonEmptyStr | int
    source: str | Named
    budget: Annotated[int, Field(ge=1)] | str


@pytest.mark.parametrize(
    ("config", "problems"),
    [
        ({"tokenizer": 3}, ["tokenizer: expected str | dict | None, got int (3)"]),
        ({"label": ""}, ["label: must have at least 1 character, got ''"]),
        ({"source": {"name": "", "x": 1}},
         ["source.name: must have at least 1 character, got ''",
          "source.x: unknown option. Known: name."]),
        ({"source": 3}, ["source: expected str | a mapping, got int (3)"]),
        ({"budget": 0}, ["budget: must be >= 1, got 0"]),
        ({"budget": 1.5}, ["budget: expected int | str, got float (1.5)"]),
    ],
)  # fmt: skip
def test_a_union_reports_the_member_the_value_fits_or_else_the_whole_union(config, problems):
    """A value with one member's type that fails inside it gets that member's problems only;
    a value of no member's type gets one line naming every member."""
    assert config_problems(Unions, config) == problems


@pytest.mark.parametrize(
    ("config", "problems"),
    [
        ({"budget": -(10**5000)}, ["budget: must be >= 1, got an int of about 5001 digits"]),
        ({"tokenizer": 10**5000},
         ["tokenizer: expected str | dict | None, got int (an int of about 5001 digits)"]),
        ({"label": [10**5000]},
         ["label: expected str | int, got list (a list that cannot be printed)"]),
    ],
)  # fmt: skip
def test_values_too_long_to_print_are_reported_not_raised(config, problems):
    """Python refuses to print ints past 4,300 digits; a problem describes them instead."""
    assert config_problems(Unions, config) == problems
