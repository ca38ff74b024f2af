"""RL algorithm building blocks at NeMo-RL's ``nemo_rl.algorithms`` paths (library layer:
torch only, no trainer framework).

- :mod:`envloop.algorithms.utils`: ``calculate_baseline_and_std_per_prompt`` (NeMo-RL's
  semantics) and the ``get_tokenizer`` helper.
- :mod:`envloop.algorithms.grpo`: ``add_grpo_token_loss_masks_and_generation_logprobs``
  (NeMo-RL's), ``group_advantages``, ``filter_informative_groups`` (DAPO's dynamic
  sampling), ``overlong_penalty`` (DAPO's) and ``training_batch``.
- :mod:`envloop.algorithms.loss`: ``clipped_pg_loss`` (PPO-clip with clip-higher and
  truncated importance sampling).
"""
