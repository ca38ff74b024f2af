"""The math environments' options (:class:`MathEnvConfig`), validated once
(:func:`config_problems`, :func:`multi_reward_config_problems`), and the check a config
selects (:func:`checker_name`). Imports nothing heavy: ``envloop run`` checks configs with it
before starting Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.environments.utils import MaxParseChars

VerifierType = Literal["math", "english_multichoice", "multilingual_multichoice", "dapo"]
MathVerifyImpl = Literal["hf_math_verify", "dapo_math_verify"]


class MathEnvConfig(TypedDict, total=False):
    num_workers: Annotated[
        int, Field(2, ge=1, description="worker processes checking answers with math-verify")
    ]
    verify_timeout_s: Annotated[
        float, Field(10.0, gt=0, description="a sample's check stops after this long; it scores 0")
    ]
    stop_strings: Annotated[
        list[str] | None, Field(None, description="stop strings for a next turn (None: EOS only)")
    ]
    reward_mode: Annotated[
        Literal["correctness", "multi"],
        Field("correctness", description="one reward, or correctness + format"),
    ]
    max_attempts: Annotated[
        int, Field(1, ge=1, description="answers per episode; a wrong one gets another try")
    ]
    observation_role: Annotated[
        str, Field("environment", min_length=1, description='role of verdicts; "user" for Qwen')
    ]
    verifier_type: Annotated[
        VerifierType | None, Field("math", description='how answers are checked (None: "math")')
    ]
    math_verify_impl: Annotated[
        MathVerifyImpl | None,
        Field("hf_math_verify", description="the check of verifier_type math (None: math-verify)"),
    ]
    max_parse_chars: MaxParseChars  # of the response, and of a text ground truth


DEFAULTS = cast(MathEnvConfig, validation.declared_defaults(MathEnvConfig))


def checker_name(config: Mapping[str, Any]) -> str:
    """Which check a (valid) config selects: ``hf_math_verify``, ``dapo_math_verify``,
    ``english_multichoice`` or ``multilingual_multichoice``.

    >>> checker_name({}), checker_name({"verifier_type": "dapo"})
    ('hf_math_verify', 'dapo_math_verify')
    >>> checker_name({"verifier_type": "math", "math_verify_impl": "dapo_math_verify"})
    'dapo_math_verify'
    """
    verifier_type = config.get("verifier_type") or "math"
    if verifier_type == "dapo":
        return "dapo_math_verify"
    if verifier_type == "math":
        return config.get("math_verify_impl") or "hf_math_verify"
    return str(verifier_type)


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``math`` config (None: the defaults), one line each; options that
    contradict each other are reported once each is valid alone.

    >>> config_problems({"max_attempts": 0, "verify_timeout_s": "10"})
    ["verify_timeout_s: expected number, got str ('10')", 'max_attempts: must be >= 1, got 0']
    """
    problems = validation.config_problems(MathEnvConfig, config)
    return problems or _combination_problems(config or {})


def multi_reward_config_problems(config: Any) -> list[str]:
    """Every problem of a ``math_multi_reward`` config: a ``math`` config with math-verify
    checks only and no ``reward_mode``.

    >>> multi_reward_config_problems({"reward_mode": "multi"})
    ['reward_mode: not an option of math_multi_reward (it has 3 rewards)']
    """
    problems = config_problems(config)
    if not isinstance(config, Mapping):
        return problems
    if "reward_mode" in config:
        problems.append("reward_mode: not an option of math_multi_reward (it has 3 rewards)")
    if checker_name(config) != "hf_math_verify" and not problems:
        problems.append(
            "verifier_type: math_multi_reward checks <answer> tags with math-verify only;"
            " drop verifier_type and math_verify_impl"
        )
    return problems


def _combination_problems(config: Mapping[str, Any]) -> list[str]:
    """Options that contradict each other (each valid alone)."""
    verifier_type = config.get("verifier_type") or "math"
    impl = config.get("math_verify_impl")
    if verifier_type == "dapo" and impl == "hf_math_verify":
        return ["math_verify_impl: 'hf_math_verify' contradicts verifier_type 'dapo'; drop one"]
    if verifier_type not in ("math", "dapo") and impl == "dapo_math_verify":
        return [
            f"math_verify_impl: 'dapo_math_verify' applies to verifier_type 'math', not "
            f"{verifier_type!r}; drop it, or use verifier_type 'dapo'"
        ]
    if config.get("reward_mode") == "multi" and checker_name(config) != "hf_math_verify":
        return [
            "reward_mode: 'multi' scores one \\boxed{} answer, a math-verify format; it needs "
            "verifier_type 'math' with math_verify_impl 'hf_math_verify'"
        ]
    return []
