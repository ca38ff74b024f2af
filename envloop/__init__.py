"""envloop: token-exact multi-turn RL experience generation for language models.

A policy (a :class:`~envloop.models.generation.interfaces.GenerationInterface`) runs
against environments (:class:`~envloop.environments.interfaces.EnvironmentInterface`,
usually Ray actors) for one or many turns; :func:`~envloop.experience.rollouts.run_multi_turn_rollout`
returns the trajectories with rewards and metrics.
"""

__version__ = "0.1.0"
