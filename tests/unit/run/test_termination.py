"""Signals during a run: while it starts up they raise at once; while it rolls out the first
one only asks it to stop (a second ends the process: tested in a process of its own, in
tests/integration/test_cli_signals.py)."""

from __future__ import annotations

import os
import signal

import pytest

from envloop.run.termination import (
    RunStopped,
    RunTerminated,
    admitting_work,
    signals_stop_the_run,
    stop_requested,
)


def test_while_starting_up_a_signal_raises_at_once():
    with signals_stop_the_run("envloop run c.yaml --resume"):
        with pytest.raises(RunTerminated, match="stopped by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # let the handler run
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0)


def test_while_rolling_out_the_first_signal_asks_the_run_to_stop(capfd):
    before = signal.getsignal(signal.SIGINT)
    with signals_stop_the_run("envloop run c.yaml --resume"), admitting_work():
        assert stop_requested() is None
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
        assert stop_requested() == signal.SIGTERM
    assert "stopped by SIGTERM: finishing the samples in flight" in capfd.readouterr().err
    assert stop_requested() is None and signal.getsignal(signal.SIGINT) is before


def test_a_stopped_run_exits_with_128_plus_the_signal():
    stopped = RunStopped(signal.SIGINT, 3, 8, "runs/a")
    assert (str(stopped), stopped.exit_status) == ("interrupted (Ctrl-C)", 130)
    assert RunStopped(signal.SIGTERM, 3, 8, "runs/a").exit_status == 143
