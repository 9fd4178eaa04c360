"""Every write through one helper (poros/common/atomic.py): a file is whole or as it was, a row appended whole or not
at all, and a failure is one line naming what and where. The failures are real: each case runs in a process whose
file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored as Python ignores it) the write exceeds, beside a control without
the limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from poros.common.atomic import append_line, atomic_folder, atomic_path, write_atomic
from poros.errors import WriteError

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4096  # bytes a file may grow to in the limited process


def limited(code: str, limit: int | None = LIMIT, cwd=None) -> subprocess.CompletedProcess:
    """Run `code` (Python) in a process whose files may not grow past `limit` bytes (None: no limit)."""
    prelude = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        LIMIT = {limit!r}
        if LIMIT is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})


WRITE = """
    import sys
    from poros.common.atomic import write_atomic
    from poros.errors import WriteError
    try:
        write_atomic({path!r}, "x" * {size}, "the page")
    except WriteError as e:
        print(e)
        raise SystemExit(2)
"""


def test_a_file_past_the_size_limit_leaves_the_old_one_whole_and_no_temporary(tmp_path):
    target = tmp_path / "page.md"
    target.write_text("the old page\n")
    done = limited(WRITE.format(path=str(target), size=3 * LIMIT))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout == (f"cannot write the page {target} (File too large); raise the file-size limit "
                           "(ulimit -f)\n"), done.stdout
    assert target.read_text() == "the old page\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md"], "no partial file left behind"
    control = limited(WRITE.format(path=str(target), size=3 * LIMIT), limit=None)
    assert control.returncode == 0 and target.read_text() == "x" * 3 * LIMIT


def test_a_row_past_the_size_limit_is_cut_back_and_the_file_keeps_every_complete_row(tmp_path):
    rows = tmp_path / "results.jsonl"
    code = f"""
        from poros.harness.results import ResultsWriter
        from poros.errors import WriteError
        w = ResultsWriter({str(rows)!r})
        for i in range(20):
            try:
                w.append({{"matrix": "m", "model": str(i), "status": "ok", "pad": "p" * 700}})
            except WriteError as e:
                print(e)
                raise SystemExit(2)
    """
    done = limited(code)
    assert done.returncode == 2 and "cannot write a row to" in done.stdout and "(File too large)" in done.stdout, \
        done.stdout + done.stderr[-2000:]
    assert "every complete row is kept; --resume continues once there is room" in done.stdout
    text = rows.read_text()
    assert text.endswith("\n") and 0 < len(text) <= LIMIT
    kept = [json.loads(x) for x in text.splitlines()]  # every line whole
    assert [r["model"] for r in kept] == [str(i) for i in range(len(kept))]
    control = limited(code, limit=None)
    assert control.returncode == 0 and len(rows.read_text().splitlines()) == len(kept) + 20


def test_the_helpers_keep_what_was_there_when_the_writer_fails(tmp_path):
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")

    def full():
        raise OSError(28, "No space left on device")

    with pytest.raises(WriteError, match=r"cannot write the plot .*plot.png \(No space left on device\); free space"):
        with atomic_path(target, "the plot") as tmp:
            assert tmp.suffix == ".png" and tmp.parent == tmp_path, "beside it, with its suffix"
            tmp.write_bytes(b"new, cut short")
            full()
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    with pytest.raises(WriteError, match="cannot write the merged checkpoint"):
        with atomic_folder(tmp_path / "merged", "the merged checkpoint") as tmp:
            (tmp / "model.safetensors").write_bytes(b"part")
            full()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    with pytest.raises(ValueError):  # another error passes through as it is; the temporary goes all the same
        with atomic_path(target, "the plot") as tmp:
            tmp.write_bytes(b"x")
            raise ValueError("not a write failure")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    # controls: each writes when nothing fails
    write_atomic(target, b"new")
    with atomic_folder(tmp_path / "merged") as tmp:
        (tmp / "config.json").write_text("{}")
    append_line(tmp_path / "rows.jsonl", b"{}\n")
    assert target.read_bytes() == b"new" and (tmp_path / "merged/config.json").read_text() == "{}"
    assert (tmp_path / "rows.jsonl").read_bytes() == b"{}\n"


def test_poros_report_past_the_size_limit_is_one_line_and_leaves_no_page(tmp_path):
    from tests.harness.test_report import fixture_row, write_jsonl

    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(), fixture_row(method="resident")])
    code = f"""
        import sys
        from poros.cli import main
        sys.exit(main(["report", {str(results)!r}, "-o", {str(tmp_path / "page.md")!r}]))
    """
    done = limited(code, limit=8192)  # the PNG is larger, the page smaller
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith(f"poros report: error: cannot write the plot {tmp_path / 'page.png'} (File too "
                                  "large)") and len(done.stderr.splitlines()) == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]
    control = limited(code, limit=None)
    assert control.returncode == 0 and (tmp_path / "page.md").is_file() and (tmp_path / "page.png").is_file()


def test_a_folder_a_killed_writer_left_is_removed_by_the_next_write(tmp_path):
    """An export killed mid-write (SIGKILL) leaves its hidden temporary folder, a checkpoint's size; the next
    write of that folder removes it. One that a running writer fills is left alone (the control)."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has ended
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        abandoned = tmp_path / f".merged.{dead_pid}.partial"
        filling = tmp_path / f".merged.{running.pid}.partial"
        other = tmp_path / f".other.{dead_pid}.partial"  # another target's: not this write's to remove
        for d in (abandoned, filling, other):
            d.mkdir()
            (d / "model-00001.safetensors").write_bytes(b"shard")
        with atomic_folder(tmp_path / "merged") as tmp:
            (tmp / "config.json").write_text("{}")
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == sorted(["merged", filling.name, other.name]), names
    finally:
        running.kill()
        running.wait()
