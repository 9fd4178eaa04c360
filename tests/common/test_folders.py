"""Output folders: one run owns a folder (a second is refused naming the first, a killed run's lock is taken
over), and a folder that cannot be one is refused in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from poros.common.folders import LOCK_NAME, OutputInUse, OutputLock, ensure_folder
from poros.errors import PorosError

REPO = Path(__file__).resolve().parents[2]


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes the folder's lock and keeps it until killed."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from poros.common.folders import OutputLock; "
            f"OutputLock({str(folder)!r}, command='poros bench matrix cpu -o out').acquire(); "
            f"print('locked', flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_first_and_a_killed_ones_lock_is_taken_over(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(OutputInUse) as e:
            OutputLock(tmp_path).acquire()
        msg = _one_line(e.value)
        for part in (f"pid {proc.pid}", f"host {socket.gethostname()}", "since 20", "poros bench matrix cpu -o out"):
            assert part in msg, msg
    finally:
        proc.send_signal(signal.SIGKILL)  # killed: no chance to release, the lock file stays behind
        proc.wait()
    assert (tmp_path / LOCK_NAME).is_file()
    lock = OutputLock(tmp_path).acquire()
    try:
        warning = lock.stale_warning()
        assert warning and f"pid {proc.pid}" in warning and "no longer running" in warning, warning
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_is_reentrant_within_a_process_and_held_until_the_outer_release(tmp_path):
    outer = OutputLock(tmp_path).acquire()
    inner = OutputLock(tmp_path).acquire()  # `poros bench` holds it, then its suites take it again
    inner.release()
    assert (tmp_path / LOCK_NAME).is_file()
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); "
                            f"from poros.common.folders import OutputLock; OutputLock({str(tmp_path)!r}).acquire()"],
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "OutputInUse" in probe.stderr, probe.stderr[-500:]
    outer.release()
    assert not (tmp_path / LOCK_NAME).exists()
    OutputLock(tmp_path).acquire().release()  # free again


def test_a_lock_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 7, "host": "elsewhere", "started": "2026-01-01T00:00:00"}))
    with pytest.raises(OutputInUse) as e:
        OutputLock(tmp_path).acquire()
    msg = _one_line(e.value)
    assert "host elsewhere" in msg and f"delete {tmp_path / LOCK_NAME}" in msg, msg


def test_an_output_path_that_is_a_file_or_under_one_is_refused(tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("x")
    with pytest.raises(PorosError) as e:
        ensure_folder(f)
    assert "is a file" in _one_line(e.value)
    with pytest.raises(PorosError) as e:
        OutputLock(f / "sub").acquire()
    assert str(f / "sub") in _one_line(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="requires a non-root user (root writes into read-only folders)")
def test_a_read_only_output_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(PorosError) as e:
            OutputLock(ro).acquire()
        assert "not writable" in _one_line(e.value)
    finally:
        ro.chmod(0o755)
