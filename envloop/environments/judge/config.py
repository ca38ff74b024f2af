"""The ``judge`` environment's options (:class:`JudgeEnvConfig`), their defaults and their
check (:func:`config_problems`). Imports nothing heavy: ``envloop run`` checks configs with
it before starting Ray.

The ``judge`` section is a generation backend's config given as a run's ``policy`` section
is: ``backend: hf`` (the default; :class:`~envloop.models.generation.hf_config.HfGenerationConfig`,
the judge model loaded in the environment's actor) or ``backend: server``
(:class:`~envloop.models.generation.server_config.ServerGenerationConfig`, inference servers
over HTTP), each with its own sampling settings. A given ``judge`` section replaces the
default one whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import Discriminator, Field, Tag, field_validator
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.environments.judge.templates import template_problem
from envloop.environments.utils import MaxParseChars
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.server_config import ServerGenerationConfig

__all__ = ["DEFAULTS", "JudgeEnvConfig", "VerdictConfig", "config_problems", "validate_config"]


class HfJudgeConfig(HfGenerationConfig, title="judge"):
    """A judge generating in the environment's process with transformers."""

    backend: Literal["hf"] = "hf"
    """``hf`` (transformers, in the environment's actor) or ``server`` (inference servers)."""

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, backend: Any) -> Any:
        if backend not in ("hf", "server"):
            raise ValueError(f"{backend!r} is not a backend; use hf or server")
        return backend


class ServerJudgeConfig(ServerGenerationConfig, title="judge"):
    """A judge served by inference servers (vLLM, SGLang, llama.cpp)."""

    backend: Literal["server"]
    """``server``: judge with the servers at ``base_urls``."""


def _backend_of(value: Any) -> str:
    backend = value.get("backend", "hf") if isinstance(value, Mapping) else value.backend
    return backend if backend in ("hf", "server") else "hf"  # hf reports a bad value


JudgeBackendConfig = Annotated[
    Annotated[HfJudgeConfig, Tag("hf")] | Annotated[ServerJudgeConfig, Tag("server")],
    Discriminator(_backend_of),
]
DEFAULT_JUDGE = {"backend": "hf", "model_name": "bundled:judge", "max_new_tokens": 64}


class VerdictConfig(TypedDict, total=False):
    kind: Annotated[
        Literal["yes_no", "number", "json", "label"],
        Field("yes_no", description="yes_no, number (in [min, max]), json (a field), label"),
    ]
    min: Annotated[float, Field(0, description="number/json: the lowest score (-> 0)")]
    max: Annotated[float, Field(10, description="number/json: the highest score (-> 1)")]
    after: Annotated[
        str | None, Field(None, description="number: read the number after this text's last use")
    ]
    field: Annotated[str, Field("score", min_length=1, description="json: the field read")]
    labels: Annotated[
        dict[str, float] | None,
        Field(None, description="label: each label's score in [0, 1], e.g. {A: 1, B: 0}"),
    ]
    yes: Annotated[list[str], Field(["yes"], min_length=1, description="yes_no: words for 1")]
    no: Annotated[list[str], Field(["no"], min_length=1, description="yes_no: words for 0")]


def _section(spec: type, description: str) -> Any:
    return Field(
        default_factory=lambda: validation.declared_defaults(spec), description=description
    )


class JudgeEnvConfig(TypedDict, total=False):
    judge: Annotated[
        JudgeBackendConfig,
        Field(
            default_factory=lambda: dict(DEFAULT_JUDGE),
            validate_default=True,
            description="the judge's generation backend, as a run's policy section",
        ),
    ]
    template: Annotated[
        str,
        Field(
            "reference_equivalence",
            description="built-in (reference_equivalence, rubric, group_comparison) or a file",
        ),
    ]
    verdict: Annotated[VerdictConfig, _section(VerdictConfig, "how a judgement is read")]
    num_judgements: Annotated[int, Field(1, ge=1, description="judgements per sample")]
    aggregate: Annotated[
        Literal["mean", "majority"],
        Field("mean", description="how several judgements make one score"),
    ]
    greedy: Annotated[bool, Field(True, description="judge greedily (one judgement only)")]
    mode: Annotated[
        Literal["sample", "group"],
        Field("sample", description="sample: one call per sample; group: one per prompt"),
    ]
    group_reward: Annotated[
        Literal["score", "rank"],
        Field("score", description="group: the judge's score, or the share of members beaten"),
    ]
    on_failure: Annotated[
        Literal["error", "zero"],
        Field("error", description="error: the sample fails (loss_multiplier 0); zero: score 0"),
    ]
    max_attempts: Annotated[int, Field(1, ge=1, description="answers per episode")]
    pass_score: Annotated[
        float, Field(1.0, ge=0, le=1, description="an episode ends at a score this high")
    ]
    max_verdict_chars: Annotated[
        int, Field(4000, ge=1, description="the judge reply's last characters parsed")
    ]
    max_prompt_tokens: Annotated[
        int, Field(4096, ge=1, description="a longer judge prompt fails its sample")
    ]
    observation_role: Annotated[
        str, Field("environment", min_length=1, description="role of the judge's observations")
    ]
    num_cpus: Annotated[float, Field(1, ge=0, description="CPUs Ray reserves for the actor")]
    max_parse_chars: MaxParseChars  # of a response rendered into the judge prompt


DEFAULTS = cast(JudgeEnvConfig, validation.declared_defaults(JudgeEnvConfig))


def config_problems(config: Any = None) -> list[str]:
    """Every problem of a ``judge`` config (None: the defaults), one line each.

    >>> config_problems({"num_judgement": 3, "mode": "pairs"})  # doctest: +NORMALIZE_WHITESPACE
    ["mode: 'pairs' is not one of sample, group",
     "num_judgement: unknown option. Did you mean 'num_judgements'?"]
    """
    problems = validation.config_problems(JudgeEnvConfig, config)
    if problems or config is None:
        return problems
    merged = _merged(config)
    return _value_problems(merged)


def validate_config(config: Any = None) -> dict[str, Any]:
    """``config`` over :data:`DEFAULTS`; one ConfigError lists every problem."""
    from envloop.config.errors import ConfigError

    problems = config_problems(config)
    if problems:
        raise ConfigError("JudgeEnvConfig", problems)
    return _merged(config or {})


def _merged(config: Mapping[str, Any]) -> dict[str, Any]:
    merged = validation.validated(JudgeEnvConfig, config)
    merged["verdict"] = {**DEFAULTS["verdict"], **config.get("verdict", {})}
    return merged


def _value_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    why = template_problem(config["template"])
    if why:
        problems.append(why)
    verdict = config["verdict"]
    if verdict["kind"] in ("number", "json") and not verdict["min"] < verdict["max"]:
        problems.append(f"verdict.min: must be below verdict.max, got {verdict['min']} >= "
                        f"{verdict['max']}")  # fmt: skip
    if verdict["kind"] == "label":
        labels = verdict["labels"]
        if not labels:
            problems.append("verdict.labels: kind label needs labels, e.g. {A: 1.0, B: 0.0}")
        elif any(not 0 <= v <= 1 for v in labels.values()) or any(not k for k in labels):
            problems.append("verdict.labels: each label must be non-empty, its score in [0, 1]")
    if config["greedy"] and config["num_judgements"] > 1:
        problems.append(
            f"num_judgements: {config['num_judgements']} greedy judgements are all the same; "
            "set greedy: false to sample them, or num_judgements: 1"
        )
    return problems
