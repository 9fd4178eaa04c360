"""Results files: rows are appended and a matrix's finished cells read back, earlier files are kept, torn lines are
set aside, unreadable files are refused in one line (who owns an output folder: tests/common/test_folders.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poros.harness.results import ResultsFileError, ResultsWriter, keep_earlier

def whole_row(**fields) -> dict:
    """A results row with every key the schema requires (poros/harness/record_schema.py), `fields` over it."""
    from poros.harness.record_schema import ROW_REQUIRED

    row = {**dict.fromkeys(ROW_REQUIRED), "matrix": "t", "model": "a", "stack": "current", "stack_name": "current",
           "method": "poros", "arch": "", "status": "ok", "steps": 2, "passes": 1, "warmup_passes": 1,
           "reduced": False, "config": {}, "provenance": {}}
    return {**row, **fields}


ROW = whole_row()


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


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


def test_a_full_disk_during_a_row_write_keeps_every_complete_row(tmp_path, monkeypatch):
    """The disk fills mid-row: the part written is cut back off, the error is one line, earlier rows stay."""
    import errno
    import os

    import poros.common.atomic as atomic
    from poros.errors import WriteError
    from poros.harness.results import ResultsWriter

    w = ResultsWriter(tmp_path / "results.jsonl")
    w.append(whole_row(model="a"))
    before = w.path.read_bytes()
    real = os.write

    def full(fd, data):
        real(fd, data[:7])  # part of the line reaches the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "write", full)
    with pytest.raises(WriteError) as e:
        w.append(whole_row(model="b"))
    assert str(e.value).startswith(f"cannot write a row to {w.path} (No space left on device); free space; every "
                                   "complete row is kept") and "\n" not in str(e.value)
    assert w.path.read_bytes() == before
    calls = []

    def short_then_full(fd, data):  # a short write: the rest then fails with the reason
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, data[:3])
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(atomic.os, "write", short_then_full)
    with pytest.raises(WriteError, match=r"\(File too large\); raise the file-size limit \(ulimit -f\)"):
        w.append(whole_row(model="c"))
    assert w.path.read_bytes() == before
    monkeypatch.setattr(atomic.os, "write", lambda fd, data: real(fd, data[:3]))  # control: short writes that go on
    w.append(whole_row(model="d"))
    assert [r["model"] for r in w.rows()] == ["a", "d"]


@pytest.mark.parametrize("listing, kept", [(["--collect-only"], True), (["-k", "no-cell-has-this-name"], True),
                                           (["-k", "tiny-qwen2 and parity", "--max-minutes", "0.0001"], False)],
                         ids=["collect-only", "k-selects-no-cell", "control-a-run"])
def test_a_run_that_runs_nothing_leaves_an_earlier_run_where_it_is(tmp_path, listing, kept):
    """`pytest suites/ --collect-only` runs nothing, and a `-k` that selects no cell is refused in one line (as `poros
    bench` refuses it), so neither moves an earlier run aside; the control, a run that starts (one cell, stopped by
    its time budget at once), keeps the earlier one under earlier/1/."""
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "results.jsonl").write_text(json.dumps(ROW) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "pytest", str(repo / "suites"), "--matrix=cpu", "-q", "-p",
                           "no:cacheprovider", f"--results={tmp_path / 'results.jsonl'}", *listing],
                          cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    out = done.stdout[-2000:] + done.stderr[-2000:]
    if listing[:2] == ["-k", "no-cell-has-this-name"]:
        said = "matrices/cpu.yaml: no cell matched -k 'no-cell-has-this-name' (cell ids read like "
        assert done.returncode == 4 and said in out, out
    else:
        # 5: no test selected; 1: a part stopped by its time budget before it recorded anything
        assert done.returncode in (0, 1, 5), out
    assert (tmp_path / "results.jsonl").exists() is kept
    assert (tmp_path / "earlier" / "1" / "results.jsonl").exists() is not kept


def test_results_writer_appends_and_reports_done(tmp_path):
    w = ResultsWriter(tmp_path / "r.jsonl")
    w.append(whole_row())
    w.append(whole_row(method="resident", status="failed"))
    w.append(whole_row(matrix="u", method="resident"))
    assert set(w.done("t")) == {("a", "current", "poros", None, "")}
    assert len(w.rows()) == 3


def test_only_pass_indices_0_to_passes_minus_1_count_each_once(tmp_path):
    """Pass records added by hand (an index beyond the passes, a second record of a pass, one after a gap) count for
    nothing and are named; an index below 0 is refused by the schema. Negative control: the passes as written."""
    from poros.harness.results import PassLog

    log = PassLog(tmp_path / "passes.jsonl")
    for i, s in ((0, 0.5), (1, 5.3)):
        log.add("pass", "c", "f", index=i, seconds=s)
    assert [r["seconds"] for r in log.passes("c", "f", 2)] == [0.5, 5.3] and log.ignored_passes("c", "f", 2) == []
    log.add("pass", "c", "f", index=9, seconds=99.0)
    log.add("pass", "c", "f", index=1, seconds=0.001)
    assert [r["seconds"] for r in log.passes("c", "f", 2)] == [0.5, 5.3]
    ignored = log.ignored_passes("c", "f", 2)
    assert any("pass index 9 is beyond the cell's 2 passes" in x for x in ignored), ignored
    assert any("pass 1 is recorded again (0.001 s); its first record counts" in x for x in ignored), ignored
    gap = PassLog(tmp_path / "gap.jsonl")
    for i in (0, 2):
        gap.add("pass", "c", "f", index=i, seconds=1.0)
    assert len(gap.passes("c", "f", 3)) == 1 and "pass 2 follows a pass never recorded (1)" in gap.ignored_passes("c", "f", 3)[0]
    gap.add("pass", "c", "f", index=-1, seconds=1.0)
    with pytest.raises(ResultsFileError, match=r"gap.jsonl:3: field index: expected an integer >= 0, got -1"):
        gap.passes("c", "f", 3)


def test_a_fresh_run_moves_the_old_gate_references_with_the_rest(tmp_path):
    (tmp_path / "passes.jsonl").write_text("")
    (tmp_path / "gate-references").mkdir()
    (tmp_path / "gate-references" / "abc.json.gz").write_bytes(b"x")
    kept, names = keep_earlier(tmp_path)
    assert "gate-references" in names and (kept / "gate-references" / "abc.json.gz").exists()
    assert not (tmp_path / "gate-references").exists()
