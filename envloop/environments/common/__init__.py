"""Pieces several environments share: a process pool with hard per-task timeouts, an
in-order pool of Ray workers, answer extraction (``\\boxed{}``, tags, after thinking) and
math-verify checks.
"""
