"""The judge environment's parts: config, prompt templates, verdict parsers, judge calls
(see :mod:`envloop.environments.judge_environment`)."""
