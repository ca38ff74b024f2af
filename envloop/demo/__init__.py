"""The bundled demo: a tiny policy, reward model and vision-language policy shipped with the
package.

The policy and reward model were trained on CPU by ``scripts/train_demo_policy.py`` and
``scripts/train_demo_reward_model.py`` on the synthetic tasks of :mod:`envloop.demo.tasks`
(arithmetic in ``\\boxed{}``, retrying after ``Environment: incorrect``, small sliding
puzzles); the VLM policy (a tiny Qwen2.5-VL) by ``scripts/train_demo_vlm_policy.py`` on the
pictures of coloured shapes of :mod:`envloop.demo.shapes` (counting them, locating one with
a box). So the demos show real rewards on a fresh machine with no downloads. Each lives
in a ``from_pretrained``-loadable folder (ChatML template, EOS ``<|im_end|>``, pad
``<|endoftext|>``; the VLM's folder also holds its image processor). Wherever a model or
tokenizer path is accepted (``envloop run``, ``HfGenerationConfig.model_name`` /
``tokenizer_name``, the reward model's ``model_name`` and ``tokenizer``), ``bundled:<name>``
resolves to their folders through :func:`envloop.models.bundled.resolve_model` (re-exported
here).
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
