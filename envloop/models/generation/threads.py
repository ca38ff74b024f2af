"""How many CPU threads torch uses in this process, set once from a config.

torch's default intra-op thread count is the number of cores. On a machine that also runs
Ray environment actors and verifier processes, those threads spin against the other
processes and generation on CPU gets many times slower (measured on a busy 2-core machine:
10-30x) while producing identical outputs; one thread per process is the robust default.
The setting is process-wide: every torch operation in the process uses it afterwards.
"""

from __future__ import annotations

import contextlib

DEFAULT_CPU_THREADS = 1
"""torch threads per process that runs a model on CPU (see the module docstring)."""


def set_cpu_threads(num_threads: int | None) -> int:
    """Set torch's intra-op threads (and, when still possible, its inter-op threads) of
    this process to ``num_threads``; None leaves torch's defaults. Returns the intra-op
    thread count in effect.

    torch accepts the inter-op count only before the process's first parallel work and only
    once; after that it keeps its own, which this call leaves as it is.

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> set_cpu_threads(1)
    1
    >>> set_cpu_threads(None)
    1
    >>> _ = set_cpu_threads(before)
    """
    import torch  # here: configs read DEFAULT_CPU_THREADS without importing torch

    if num_threads is None:
        return torch.get_num_threads()
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
    torch.set_num_threads(num_threads)
    # Refused once set or once parallel work ran; torch then keeps its inter-op pool.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(num_threads)
    return torch.get_num_threads()
