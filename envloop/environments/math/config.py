"""The math environments' options (:class:`MathEnvConfig`), validated once
(:func:`config_problems`, :func:`multi_reward_config_problems`), and the check a config
selects (:func:`checker_name`). Imports nothing heavy: ``envloop run`` checks configs with it
before starting Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from envloop.config.errors import typed_dict_problems

VerifierType = Literal["math", "english_multichoice", "multilingual_multichoice", "dapo"]
MathVerifyImpl = Literal["hf_math_verify", "dapo_math_verify"]


class MathEnvConfig(TypedDict, total=False):
    num_workers: int  # worker processes checking answers with math-verify (default 2)
    verify_timeout_s: float  # a sample's check is stopped after this long and scores 0 (10)
    stop_strings: list[str] | None  # stop strings for a next turn (default None: EOS only)
    reward_mode: Literal["correctness", "multi"]  # one reward, or correctness + format
    max_attempts: int  # answers per episode; after a wrong one the policy tries again (1)
    observation_role: str  # role of the verdicts; "user" for Qwen templates ("environment")
    verifier_type: VerifierType | None  # how answers are checked (None: "math")
    math_verify_impl: MathVerifyImpl | None  # the check of verifier_type math (None: math-verify)


DEFAULTS: MathEnvConfig = {
    "num_workers": 2,
    "verify_timeout_s": 10.0,
    "stop_strings": None,
    "reward_mode": "correctness",
    "max_attempts": 1,
    "observation_role": "environment",
    "verifier_type": "math",
    "math_verify_impl": "hf_math_verify",
}


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
    """Every problem of a ``math`` config (None: the defaults), one line each.

    >>> config_problems({"max_attempts": 0, "verify_timeout_s": "10"})
    ["verify_timeout_s: expected float, got str ('10')", 'max_attempts: must be at least 1, got 0']
    """
    if config is None:
        return []
    problems = typed_dict_problems(config, MathEnvConfig)
    if not isinstance(config, Mapping):
        return problems
    workers, timeout = config.get("num_workers", 2), config.get("verify_timeout_s", 10.0)
    if isinstance(workers, int) and workers < 1:
        problems.append(f"num_workers: must be at least 1, got {workers}")
    if isinstance(timeout, (int, float)) and timeout <= 0:
        problems.append(f"verify_timeout_s: must be > 0 seconds, got {timeout}")
    attempts = config.get("max_attempts", 1)
    if isinstance(attempts, int) and attempts < 1:
        problems.append(f"max_attempts: must be at least 1, got {attempts}")
    if config.get("observation_role", "environment") == "":
        problems.append("observation_role: must be a role name such as 'environment' or 'user'")
    return problems or _combination_problems(config)


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
