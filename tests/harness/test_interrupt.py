"""`poros bench`'s Ctrl-C: a KeyboardInterrupt Python loses (raised inside a finalizer that garbage collection
runs, where it is only reported) still stops the run at the next step (poros/harness/timing.py)."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest

from poros.harness.console import interrupt_on_sigint, stop_if_interrupted


class _SignalledWhileFinalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, inside the finalizer


def _ctrl_c_during_garbage_collection() -> None:
    obj = _SignalledWhileFinalized()
    obj.cycle = obj  # freed only by the collector
    del obj
    gc.collect()


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_a_ctrl_c_lost_in_a_finalizer_stops_at_the_next_check():
    with interrupt_on_sigint():
        _ctrl_c_during_garbage_collection()  # the KeyboardInterrupt goes nowhere
        with pytest.raises(KeyboardInterrupt):
            stop_if_interrupted()
    stop_if_interrupted()  # the flag ends with the run


def test_without_the_handler_the_same_ctrl_c_is_lost():
    """Negative control: Python's own handler raises it in the finalizer, and nothing remembers it."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _ctrl_c_during_garbage_collection()
    stop_if_interrupted()


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt_on_sigint():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            stop_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_elsewhere_raises_at_once():
    with interrupt_on_sigint(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
