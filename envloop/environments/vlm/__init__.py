"""The ``vlm`` environment's helpers: its config and the reward functions
:mod:`envloop.environments.rewards` combines (the environment is in
:mod:`envloop.environments.vlm_environment`).
"""
