"""Ending a run whose Ray head node is lost, with a clear error and a resumable directory.

Every Ray process keeps a connection to the GCS, which runs on the head node. When the head
dies, Ray's core worker in the driver retries for ``gcs_rpc_server_reconnect_timeout_s``
(60 s by default) and then ends the process with its own one-line log message, exit status
1: nothing of envloop runs after that, so nothing would say what happened or how to go on.

While a run rolls out, :class:`HeadWatch` probes the GCS address (a TCP connection, every
second, on a thread of its own). When the GCS has not accepted a connection for
:func:`give_up_after_s` seconds (10 s less than Ray's own limit: 50 s by default), it ends
the process first: it waits for the journal's write under way to end (so no file ends in a
partial line), prints what happened, how many samples are kept and the command that
resumes, and exits with status :data:`EXIT_STATUS`. Every sample recorded is kept, as
after a kill; the samples in flight are lost (see docs/resume.md). A GCS that answers
again before that (a head restarted with GCS fault tolerance) does not end the run: the
count starts again at the next silence.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress

from envloop.run.journal import RunJournal

__all__ = ["EXIT_STATUS", "HeadWatch", "give_up_after_s"]

EXIT_STATUS = 1
"""The exit status of a run that lost its Ray head node (as Ray's own exit)."""

RAY_RECONNECT_VARIABLE = "RAY_gcs_rpc_server_reconnect_timeout_s"
RAY_RECONNECT_DEFAULT_S = 60.0
MARGIN_S = 10.0
"""How long before Ray's own limit the run gives up."""
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0
WRITE_WAIT_S = 30.0
"""Longest wait for the journal's write under way before exiting anyway."""


def give_up_after_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds without an answer from the GCS after which the run ends: Ray's
    ``RAY_gcs_rpc_server_reconnect_timeout_s`` (60 s when unset) minus 10 s, at least 1 s.

    >>> give_up_after_s({}), give_up_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "25"})
    (50.0, 15.0)
    """
    variables: Mapping[str, str] = os.environ if environ is None else environ
    try:
        ray_limit = float(variables.get(RAY_RECONNECT_VARIABLE, RAY_RECONNECT_DEFAULT_S))
    except ValueError:
        ray_limit = RAY_RECONNECT_DEFAULT_S
    return max(1.0, ray_limit - MARGIN_S)


class HeadWatch:
    """Watches the GCS at ``gcs_address`` (``host:port``; None: nothing to watch) while the
    run writes ``journal`` (see the module docstring); ``resume_command`` (the command line
    that resumes, when known) is printed when the head is lost. Use as a context manager;
    the watch ends with the block."""

    def __init__(
        self,
        gcs_address: str | None,
        journal: RunJournal,
        resume_command: Callable[[], str | None],
        give_up_after: float | None = None,
    ) -> None:
        host, _, port = (gcs_address or ":0").rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.journal, self.resume_command = journal, resume_command
        self.give_up_after = give_up_after_s() if give_up_after is None else give_up_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="envloop-head-watch", daemon=True)

    def __enter__(self) -> HeadWatch:
        if self.port:
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def answers(self) -> bool:
        """Whether the GCS accepts a TCP connection now."""
        try:
            with socket.create_connection((self.host, self.port), timeout=PROBE_TIMEOUT_S):
                return True
        except OSError:
            return False

    def _watch(self) -> None:
        silent_since: float | None = None
        while not self._stop.wait(PROBE_INTERVAL_S):
            if self.answers():
                silent_since = None
                continue
            now = time.monotonic()
            silent_since = now if silent_since is None else silent_since
            if now - silent_since >= self.give_up_after and not self._stop.is_set():
                self._give_up(now - silent_since)

    def _give_up(self, silent_s: float) -> None:
        """Print what happened and how to resume, then end the process (the journal's write
        under way first ends, so its files hold whole lines)."""
        writing = self.journal.write_lock.acquire(timeout=WRITE_WAIT_S)
        journal = self.journal
        command = self.resume_command()
        lines = [
            f"envloop run: lost the Ray head node: its GCS at {self.host}:{self.port} has not "
            f"answered for {silent_s:.0f} s (the head node died, or the network to it), and "
            "the run cannot go on without it.",
            f"envloop run: {journal.finished} of {journal.total} samples finished, kept in "
            f"{journal.run_dir} (resumable; the samples in flight are lost and roll out "
            "again on --resume).",
            "envloop run: start the cluster again (or leave ray.address unset for a local "
            "session; ray.* may change on --resume), then resume with: "
            + (command or "envloop run CONFIG [the same key=value ...] --resume"),
        ]
        if not writing:
            lines.insert(1, f"envloop run: the journal's write did not end in {WRITE_WAIT_S:.0f} s")
        with suppress(OSError):
            os.write(2, ("\n" + "\n".join(lines) + "\n").encode())
        os._exit(EXIT_STATUS)
