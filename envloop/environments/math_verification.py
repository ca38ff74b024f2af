"""Math answer equivalence with math-verify, in worker processes with hard timeouts.

math-verify times itself out with ``signal.alarm``, which fails off a process's main thread
(thread pools, threaded or async Ray actors). :class:`MathVerifier` runs every check on the
main thread of a worker process of a :class:`~envloop.environments.process_pool.HardTimeoutPool`,
so a pathological answer scores 0 after ``timeout_s`` and the rest of the batch goes on.
"""

from __future__ import annotations

from collections.abc import Sequence

# Imported here, not in math_equivalent: a (re)started worker pays for it while starting,
# never inside an item's time limit.
from math_verify import parse, verify

from envloop.environments.process_pool import HardTimeoutPool, Outcome


def math_equivalent(pair: tuple[str, str]) -> bool:
    """Whether ``answer`` (free text: the last ``\\boxed{}`` or expression is taken) equals
    ``ground_truth`` mathematically. Runs inside a worker process.

    >>> math_equivalent(("1/2", "so the answer is \\\\boxed{0.5}"))
    True
    >>> math_equivalent(("3", "\\\\boxed{4}"))
    False
    """
    ground_truth, answer = pair
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    predicted = parse(answer, parsing_timeout=None)
    return bool(gold and predicted and verify(gold, predicted, timeout_seconds=None))


class MathVerifier:
    """Checks ``(ground_truth, answer)`` pairs in ``num_workers`` processes.

    Each pair gets an :class:`Outcome`: ``value`` True/False, or ``error`` when the check
    timed out, raised, or crashed its worker (which is then replaced).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        self.pool = HardTimeoutPool(math_equivalent, num_workers, timeout_s)

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[Outcome]:
        return self.pool.map(list(pairs))

    def close(self) -> None:
        self.pool.close()
