"""Policy versions: the number that names which weights a backend serves.

A backend starts at version 0; every ``update_weights`` moves it to the version it was
given, or to the next one.
"""

from __future__ import annotations


def next_policy_version(current: int, requested: int | None) -> int:
    """The version an update to ``requested`` (None: the next one) moves ``current`` to.

    >>> next_policy_version(3, None)
    4
    >>> next_policy_version(3, 7)
    7
    >>> next_policy_version(3, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: update_weights(version=2) would move the policy version backwards from 3; ...
    """
    if requested is None:
        return current + 1
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise TypeError(
            f"update_weights(version={requested!r}): the version must be an int, or None "
            f"for the next one ({current + 1})."
        )
    if requested < current:
        raise ValueError(
            f"update_weights(version={requested}) would move the policy version backwards "
            f"from {current}; give a version >= {current}, or version=None for the next one "
            f"({current + 1})."
        )
    return requested
