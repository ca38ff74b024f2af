"""Math answer equivalence with math-verify, in worker processes with hard timeouts.

math-verify times itself out with ``signal.alarm``, which fails off a process's main thread
(thread pools, threaded or async Ray actors). :class:`MathVerifier` runs every check on the
main thread of a worker process of a :class:`~envloop.environments.process_pool.HardTimeoutPool`:

- each check is interrupted after ``timeout_s`` by ``SIGALRM`` inside its worker, which then
  goes straight on (restarting a worker costs seconds; a pathological answer such as
  ``\\boxed{9^{9^{9^{9}}}}`` is stopped this way);
- a worker stuck where no signal reaches it (a long C call) is killed after ``2 * timeout_s``
  and replaced, as is one that dies. Either way only that sample fails; the rest of the
  batch goes on.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import Any

# Imported here, not in math_equivalent: a (re)started worker pays for it while starting,
# never inside an item's time limit.
from math_verify import parse, verify

from envloop.environments.process_pool import HardTimeoutPool, Outcome

# math-verify warns once per process that its own timeouts are off: deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)


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
        self.timeout_s = float(timeout_s)
        self.pool = HardTimeoutPool(verify_within, num_workers, 2 * self.timeout_s)

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, answer)``, in order."""
        return self.pool.map([(pair, self.timeout_s) for pair in pairs])

    def close(self) -> None:
        self.pool.close()


def verify_within(task: tuple[tuple[str, str], float]) -> bool:
    """Runs in a worker process: ``math_equivalent(pair)``, interrupted after ``timeout_s``."""
    pair, timeout_s = task
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return math_equivalent(pair)
    except _CheckTimedOut:
        raise TimeoutError(f"timed out after {timeout_s} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class _CheckTimedOut(BaseException):
    """Raised by the alarm; a BaseException so that library ``except Exception`` lets it by."""


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _CheckTimedOut
