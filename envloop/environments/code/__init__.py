"""The ``code`` and ``code_jaccard`` environments' helpers: configs, the sandbox that runs
Python cells, and code-token similarity (the environments are in
:mod:`envloop.environments.code_environment` and
:mod:`envloop.environments.code_jaccard_environment`).
"""
