"""Marker lines of a child's output become events even when another process sharing the pipe wrote part of a
line just before them (data-parallel ranks print to one pipe)."""

from __future__ import annotations

import subprocess
import sys

from poros.harness.child import EOF_EVENT, ChildLines, emit

PASS = "MARK_PASS "


def _child(text: str) -> subprocess.Popen:
    code = f"import sys; sys.stdout.write({text!r}); sys.stdout.flush()"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _read(text: str) -> tuple[list, list[str]]:
    logged: list[str] = []
    lines = ChildLines(_child(text), {PASS: "pass"}, log=logged.append)
    events = []
    while (event := lines.next())[0] != EOF_EVENT:
        events.append(event)
    lines.join()
    return events, logged


def test_a_marker_after_a_partial_line_of_another_process_is_an_event():
    events, logged = _read('  time: pass 1/1 0.2 sMARK_PASS {"seconds": 0.5}\n\nstep 2\n')
    assert events == [("pass", {"seconds": 0.5})]
    assert logged == ["  time: pass 1/1 0.2 s", "", "step 2"]


def test_another_process_s_text_after_a_marker_goes_to_the_log():
    # an unbuffered child printed the marker and its newline in two writes, another rank's line between them
    events, logged = _read('MARK_PASS {"seconds": 0.5}  time: pass 1/1 0.1 s\n\n')
    assert events == [("pass", {"seconds": 0.5})]
    assert logged == ["  time: pass 1/1 0.1 s", ""]


def test_emit_writes_the_marker_and_its_newline_at_once(capsys, monkeypatch):
    import sys

    writes: list[str] = []
    monkeypatch.setattr(sys.stdout, "write", writes.append)
    emit(PASS, {"seconds": 0.5})
    assert writes == ['MARK_PASS {"seconds": 0.5}\n']


def test_a_line_without_a_marker_is_no_event():
    # the negative control: a marker's name without its trailing space is text, not an event
    events, logged = _read('MARK_PASS{"seconds": 0.5}\nMARK_PASS {"seconds": 1.0}\n')
    assert events == [("pass", {"seconds": 1.0})]
    assert logged == ['MARK_PASS{"seconds": 0.5}']
