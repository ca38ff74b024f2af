"""The ``reward_model`` environment's helpers: its config (NeMo-RL's keys and aliases) and
checks, loading the model and tokenizer, and length-sorted or packed batching (the
environment is in :mod:`envloop.environments.reward_model_environment`).
"""
