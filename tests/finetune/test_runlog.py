"""The run's console and files: plain progress lines off a terminal, a bar on one, log.csv cut back
to the checkpoint on resume, and the two-stage Ctrl-C."""

from __future__ import annotations

import io
import signal

import pytest

from poros.finetune.runlog import LOG_COLUMNS, Progress, RunLog, StopRequest


def test_plain_lines_off_a_terminal():
    out = io.StringIO()
    bar = Progress(total=200, start=100, stream=out, tty=False)
    for step in range(101, 201):
        bar.update(step, 2.5, 1234.0)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    steps = [int(l.split()[1].split("/")[0]) for l in lines]
    assert steps == [101, *range(102, 201, 2)], "the first step, every (200-100)//50 = 2nd, and the last"
    assert lines[0] == "step 101/200 loss 2.5000 1,234 tok/s --:-- left"
    assert lines[-1].startswith("step 200/200 loss 2.5000") and lines[-1].endswith("00:00 left")


def test_a_bar_on_a_terminal_and_messages_on_their_own_line():
    out = io.StringIO()
    bar = Progress(total=4, start=0, stream=out, tty=True)
    bar.message("starting")
    bar.update(1, 3.0, 10.0)
    bar.update(2, 2.0, 10.0)
    bar.message("done")
    text = out.getvalue()
    assert text.startswith("starting\n\r[#####...............] step 1/4 loss 3.0000")
    assert "\r[##########..........] step 2/4 loss 2.0000" in text
    assert text.endswith("\ndone\n")


def test_log_keeps_rows_through_the_checkpoint_on_resume(tmp_path):
    path = tmp_path / "log.csv"
    log = RunLog(path, keep_through=0)
    for step in (1, 2, 3):
        log.append({"step": step, "loss": 1.0 / step, "lr": 0.1, "tokens_per_s": 5, "peak_memory_gb": 1})
    assert [r["step"] for r in log.rows()] == ["1", "2", "3"]
    assert list(log.rows()[0]) == list(LOG_COLUMNS) and log.rows()[0]["eval_loss"] == ""
    resumed = RunLog(path, keep_through=2)
    assert [r["step"] for r in resumed.rows()] == ["1", "2"]
    assert RunLog(path, keep_through=0).rows() == [], "a new run starts an empty log"


def test_after_the_stop_is_settled_further_signals_are_ignored_until_restored():
    """Once the stop's checkpoint is saved a second Ctrl-C has nothing to abort: ignored, wherever it lands,
    until the command restores the handlers (the control, a second Ctrl-C before that, aborts: below)."""
    from poros.finetune.runlog import restore_signals, signals_held

    before = signal.getsignal(signal.SIGINT)
    with StopRequest(lambda s: None) as stop:
        signal.raise_signal(signal.SIGINT)
        stop.settle()
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt
    assert signals_held() and signal.getsignal(signal.SIGINT) is not before
    signal.raise_signal(signal.SIGTERM)  # still ignored after the block
    restore_signals()
    assert not signals_held() and signal.getsignal(signal.SIGINT) is before


def test_first_ctrl_c_asks_second_aborts():
    said = []
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(said.append) as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and len(said) == 1 and "Ctrl-C again" in said[0]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
