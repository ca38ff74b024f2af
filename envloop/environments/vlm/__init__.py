"""The ``vlm`` environment's config (the environment is in
:mod:`envloop.environments.vlm_environment`, its reward functions in
:mod:`envloop.environments.rewards`).
"""
