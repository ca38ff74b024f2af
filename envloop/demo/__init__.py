"""The bundled demo: a tiny policy and reward model shipped with the package.

Both were trained on CPU by ``scripts/train_demo_policy.py`` and
``scripts/train_demo_reward_model.py`` on the synthetic tasks of :mod:`envloop.demo.tasks`
(arithmetic in ``\\boxed{}``, retrying after ``Environment: incorrect``, small sliding
puzzles), so ``make demo`` shows real rewards on a fresh machine with no downloads. Each
lives in a ``from_pretrained``-loadable folder (ChatML template, EOS ``<|im_end|>``, pad
``<|endoftext|>``). Wherever a model or tokenizer path is accepted (``envloop run``,
``HfGenerationConfig.model_name`` / ``tokenizer_name``, the reward model's ``model_name`` and
``tokenizer``), ``bundled:<name>`` resolves to their folders through
:func:`envloop.models.bundled.resolve_model` (re-exported here).
"""

from __future__ import annotations

from envloop.models.bundled import (
    ASSETS,
    BUNDLED_NAMES,
    BUNDLED_PREFIX,
    bundled_path,
    resolve_bundled,
    resolve_model,
)

__all__ = [
    "ASSETS",
    "BUNDLED_NAMES",
    "BUNDLED_PREFIX",
    "bundled_path",
    "resolve_bundled",
    "resolve_model",
]
