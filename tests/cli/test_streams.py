"""Standard output and error as the command line writes them (poros/cli/streams.py): text the encoding cannot
hold, a reader that went away, and a device that takes nothing each end as a user expects, never in a traceback.
Each case runs `poros` in a process of its own, beside a negative control that shows the same surroundings break
a plain Python print."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POROS = [sys.executable, "-m", "poros"]
HELP = [*POROS, "report", "--help"]  # no torch, no pandas; its epilog holds an em dash
PLAIN = [sys.executable, "-c", "print('Poros \\u2014 Validation Results ' * 20)"]  # a line like it, without poros


def _run(cmd, env=None, **kw):
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, timeout=120, **kw)


def test_text_an_ascii_console_cannot_hold_is_escaped():
    done = _run(HELP, {"PYTHONIOENCODING": "ascii"}, capture_output=True)
    assert done.returncode == 0 and b"Poros \\u2014 Official" in done.stdout, done.stderr
    control = _run(PLAIN, {"PYTHONIOENCODING": "ascii"}, capture_output=True)
    assert control.returncode != 0 and b"UnicodeEncodeError" in control.stderr


def _closed_pipe():
    """A pipe whose reader is gone before the process writes: every write to it is EPIPE."""
    r, w = os.pipe()
    os.close(r)
    return w


def test_a_closed_standard_output_ends_the_command_quietly_with_its_status(tmp_path):
    rows = [json.loads(x) for x in (ROOT / "results/cpu/results.jsonl").read_text().splitlines()]
    rows[0]["parity"] = "FAIL"  # `poros report` prints its tables, then exits 1
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = _closed_pipe()
    try:
        ok = _run(HELP, stdout=w, stderr=subprocess.PIPE, text=True)
        failing = _run([*POROS, "report", str(tmp_path / "results.jsonl"), "-o", str(tmp_path / "page.md")],
                       stdout=w, stderr=subprocess.PIPE, text=True)
        control = _run(PLAIN, stdout=w, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(w)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert failing.returncode == 1, "the command's own status, not the pipe's"
    assert failing.stderr.startswith("poros report: 1 cell(s) FAIL") and "Traceback" not in failing.stderr, \
        failing.stderr
    assert (tmp_path / "page.md").is_file()
    assert control.returncode != 0 and "BrokenPipeError" in control.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="requires /dev/full")
def test_standard_output_on_a_full_device_is_one_line_on_standard_error():
    with open("/dev/full", "wb") as full:
        done = _run(HELP, stdout=full, stderr=subprocess.PIPE, text=True)
        control = _run(PLAIN, stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 2 and done.stderr == \
        "poros: error: cannot write to standard output (No space left on device)\n", done.stderr
    assert control.returncode != 0 and "No space left on device" in control.stderr and "Traceback" in control.stderr
