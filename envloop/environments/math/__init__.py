"""The ``math`` environments' helpers: their config and its check, which check a config
selects, and the multiple-choice and DAPO answer checks (the environments themselves are in
:mod:`envloop.environments.math_environment`).
"""
