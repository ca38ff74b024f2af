"""NeMo-RL's ``nemo_rl.algorithms`` import path, for code ported from NeMo-RL (envloop has no
training algorithms; see :mod:`envloop.algorithms.utils`)."""
