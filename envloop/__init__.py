"""envloop: token-exact multi-turn RL experience generation for language models.

A policy (a ``GenerationInterface``) runs against environments (``EnvironmentInterface``,
usually Ray actors) for one or many turns; ``run_multi_turn_rollout`` returns the
trajectories with rewards and metrics.
"""

__version__ = "0.1.0"
