"""``bundled:<name>``: the models shipped with the package (the demo's tiny policy and reward
model, in ``envloop/demo/assets``), accepted wherever a model or tokenizer path is
(``envloop run``, ``HfGenerationConfig.model_name`` / ``tokenizer_name``, the reward model's
``model_name`` and ``tokenizer``, ``get_tokenizer``). See :mod:`envloop.demo` for what they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "ASSETS",
    "BUNDLED_NAMES",
    "BUNDLED_PREFIX",
    "bundled_path",
    "resolve_bundled",
    "resolve_model",
]

BUNDLED_PREFIX = "bundled:"
ASSETS = Path(__file__).resolve().parents[1] / "demo" / "assets"
BUNDLED_NAMES = ("policy", "policy_early", "reward_model", "vlm_policy", "judge")
_RECIPES = {
    "policy": "scripts/train_demo_policy.py",
    "policy_early": "scripts/train_demo_policy.py --save-at 1000 envloop/demo/assets/policy_early",
    "reward_model": "scripts/train_demo_reward_model.py",
    "vlm_policy": "scripts/train_demo_vlm_policy.py",
    "judge": "scripts/train_judge.py",
}
"""The command that writes each bundled model (``policy_early``: step 1000 of the policy's
own 1800-step run, the starting point of ``examples/grpo_train.py``)."""


def bundled_path(name: str) -> Path:
    """The folder of bundled model ``name`` (one of :data:`BUNDLED_NAMES`).

    >>> try:
    ...     bundled_path("critic")
    ... except ValueError as error:
    ...     print(str(error).split(";")[0])
    No bundled model 'critic'
    """
    if name not in BUNDLED_NAMES:
        raise ValueError(
            f"No bundled model {name!r}; the bundled models are {', '.join(BUNDLED_NAMES)} "
            "(write e.g. 'bundled:policy')."
        )
    folder = ASSETS / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"The bundled {name} is missing from {folder}; recreate it with {_RECIPES[name]}."
        )
    return folder


def resolve_model(path: str) -> str:
    """``bundled:<name>`` as that bundled model's folder; any other path unchanged.

    Raises ValueError for an unknown name, FileNotFoundError when the bundle is missing.

    >>> resolve_model("Qwen/Qwen3-0.6B")
    'Qwen/Qwen3-0.6B'
    >>> resolve_model("bundled:policy") == str(ASSETS / "policy")
    True
    """
    if not path.startswith(BUNDLED_PREFIX):
        return path
    return str(bundled_path(path[len(BUNDLED_PREFIX) :]))


def resolve_bundled(value: Any) -> Any:
    """``value`` with every ``bundled:<name>`` string inside it (nested dicts and lists
    included) replaced by that model's folder: environment configs take bundled models too.

    >>> resolve_bundled({"model_name": "bundled:reward_model", "n": [1]})["n"]
    [1]
    """
    if isinstance(value, str):
        return resolve_model(value)
    if isinstance(value, dict):
        return {k: resolve_bundled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_bundled(v) for v in value]
    return value
