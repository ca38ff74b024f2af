"""The bundled demo: a tiny policy and reward model shipped with the package.

Both were trained on CPU by ``scripts/train_demo_policy.py`` and
``scripts/train_demo_reward_model.py`` on the synthetic tasks of :mod:`envloop.demo.tasks`
(arithmetic in ``\\boxed{}``, retrying after ``Environment: incorrect``, small sliding
puzzles), so ``make demo`` shows real rewards on a fresh machine with no downloads. Each
lives in a ``from_pretrained``-loadable folder (ChatML template, EOS ``<|im_end|>``, pad
``<|endoftext|>``); wherever a model path is accepted, ``bundled:<name>`` resolves here.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
BUNDLED_NAMES = ("policy", "reward_model")


def bundled_path(name: str) -> Path:
    """The folder of bundled model ``name`` (``"policy"`` or ``"reward_model"``).

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
            f"The bundled {name} is missing from {folder}; recreate it with "
            f"scripts/train_demo_{name}.py."
        )
    return folder
