"""Results files and output folders: one run owns a folder, earlier files are kept, torn lines are
set aside, unreadable files are refused in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from poros.errors import PorosError
from poros.harness.results import LOCK_NAME, OutputInUse, OutputLock, ResultsFileError, ResultsWriter, ensure_folder, keep_earlier

REPO = Path(__file__).resolve().parents[2]
ROW = {"matrix": "t", "model": "a", "stack_name": "current", "method": "poros", "status": "ok", "steps": 2}


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes the folder's lock and keeps it until killed."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from poros.harness.results import OutputLock; "
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
                            f"from poros.harness.results import OutputLock; OutputLock({str(tmp_path)!r}).acquire()"],
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


def test_earlier_runs_are_kept_under_new_numbers_never_overwritten(tmp_path):
    for run in (1, 2, 3):
        (tmp_path / "results.jsonl").write_text(f"run {run}\n")
        (tmp_path / "report.md").write_text(f"report {run}\n")
        kept, names = keep_earlier(tmp_path)
        assert kept == tmp_path / "earlier" / str(run) and set(names) == {"results.jsonl", "report.md"}
    for run in (1, 2, 3):
        assert (tmp_path / "earlier" / str(run) / "results.jsonl").read_text() == f"run {run}\n"
        assert (tmp_path / "earlier" / str(run) / "report.md").read_text() == f"report {run}\n"
    assert not (tmp_path / "results.jsonl").exists()
    assert keep_earlier(tmp_path) == (None, [])  # nothing left to keep: no empty folder


def test_a_torn_last_line_is_set_aside_and_complete_rows_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [dict(ROW, model=m) for m in ("a", "b")]
    torn = json.dumps(dict(ROW, model="c"))[:40]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)
    w = ResultsWriter(path)
    assert w.rows() == rows  # readable before the repair too
    warning = w.repair()
    assert warning and f"{path}:3" in warning and "kept the 2 complete rows" in warning, warning
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    assert (tmp_path / "results.jsonl.torn").read_text() == torn + "\n"  # nothing is thrown away
    w.append(dict(ROW, model="c"))
    assert [r["model"] for r in ResultsWriter(path).rows()] == ["a", "b", "c"]
    assert ResultsWriter(path).repair() is None  # control: a clean file is left as it is
    assert [r["model"] for r in ResultsWriter(path).rows()] == ["a", "b", "c"]


def test_a_whole_last_row_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(ROW))
    assert ResultsWriter(path).repair() is None
    ResultsWriter(path).append(dict(ROW, model="b"))
    assert [r["model"] for r in ResultsWriter(path).rows()] == ["a", "b"]


def test_a_malformed_line_before_the_last_is_refused_naming_it(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(ROW) + "\n{broken\n" + json.dumps(ROW) + "\n")
    with pytest.raises(ResultsFileError) as e:
        ResultsWriter(path).repair()
    assert f"{path}:2" in _one_line(e.value)


def test_a_binary_results_file_is_one_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(ResultsFileError) as e:
        ResultsWriter(path).rows()
    assert str(path) in _one_line(e.value) and "UTF-8" in str(e.value)


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


def test_a_full_disk_during_a_row_write_keeps_every_complete_row(tmp_path, monkeypatch):
    """The disk fills mid-row: the part written is cut back off, the error is one line, earlier rows stay."""
    import errno
    import os

    import poros.harness.results as results_module
    from poros.harness.results import ResultsFileError, ResultsWriter

    w = ResultsWriter(tmp_path / "results.jsonl")
    w.append({"matrix": "t", "model": "a", "method": "poros", "status": "ok"})
    before = w.path.read_bytes()
    real = os.write

    def full(fd, data):
        real(fd, data[:7])  # part of the line reaches the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_module.os, "write", full)
    with pytest.raises(ResultsFileError) as e:
        w.append({"matrix": "t", "model": "b", "method": "poros", "status": "ok"})
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    assert w.path.read_bytes() == before
    monkeypatch.setattr(results_module.os, "write", lambda fd, data: real(fd, data[:3]))  # a short write
    with pytest.raises(ResultsFileError, match="only 3 of"):
        w.append({"matrix": "t", "model": "c", "method": "poros", "status": "ok"})
    assert w.path.read_bytes() == before
