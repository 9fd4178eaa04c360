"""What a long run prints and how it stops: the full log (`progress`), one compact line per cell (`begin_cell`,
`status`, `end_cell`; `StatusLine` on a terminal), the time each phase took (`phase`), and a Ctrl-C that reaches
the step loop even where Python lost its KeyboardInterrupt (`interrupt_on_sigint`, `stop_if_interrupted`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

from poros.store import host_memory

_writer = None  # every line: per-step losses, gate details (OUT/bench.log under `poros bench`)
_status = None  # the one compact line per cell (the terminal)
_cell = ""  # the current cell's label, which status updates follow
# A Ctrl-C that `poros bench` caught (`interrupt_on_sigint`). Python raises KeyboardInterrupt wherever the
# signal lands; landing in a finalizer that garbage collection ran (a cell's start frees the last cell's
# memory), it is reported as unraisable and lost. The flag stays set, and the step loop stops at the next step.
_interrupted = False
_signal: int | None = None  # which signal it was


@contextlib.contextmanager
def interrupt_on_sigint():
    """While it lasts, SIGINT (and SIGTERM, which a scheduler or `timeout` sends) raises KeyboardInterrupt as Python's
    own SIGINT handler does, so a run ends as a Ctrl-C ends it (pytest's session end writes what it keeps), and sets
    the flag that `stop_if_interrupted` reads (main thread only; a signal ignored when it started stays ignored)."""
    global _interrupted, _signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        global _interrupted, _signal
        _interrupted, _signal = True, signum
        raise KeyboardInterrupt

    _interrupted, _signal = False, None
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # started with it ignored (nohup, `&`): it stays so
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
        _interrupted = False


def interrupted_by() -> int | None:
    """The signal that interrupted the run (SIGINT or SIGTERM; None where none did)."""
    return _signal


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C was caught and its KeyboardInterrupt was lost on the way."""
    if _interrupted:
        raise KeyboardInterrupt


def set_progress_writer(writer) -> None:
    """Route progress lines through `writer(msg)` (the suites pass one that bypasses pytest's
    capture; None drops them)."""
    global _writer
    _writer = writer


def set_status_writer(writer) -> None:
    """Route the compact per-cell line through `writer(msg, final)`: `final` ends the cell's line,
    otherwise `msg` replaces what the line shows so far."""
    global _status
    _status = writer


def status_writer():
    return _status


def progress(msg: str) -> None:
    """A line of the full log (on stderr when no writer was set)."""
    if _writer is not None:
        _writer(msg)
    elif _status is None:  # one write, newline included: ranks sharing a pipe do not split each other's lines
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


def announce(msg: str) -> None:
    """A line of the full log that the compact output shows too (what a run is about to do)."""
    progress(msg)
    if _status is not None:
        _status(msg, True)


def begin_cell(label: str) -> None:
    """Start a cell's compact line, e.g. `[cell 3/16] tiny-qwen2 poros plan 24GB` (`Cell.label`)."""
    global _cell
    _cell = label
    status("…")


def status(msg: str) -> None:
    """Show `msg` as where the current cell's compact line is (a TTY rewrites the line in place)."""
    if _status is not None and _cell:
        _status(f"{_cell}: {msg}", False)


def end_cell(msg: str) -> None:
    """End the current cell's compact line with its outcome (nothing when no cell is open)."""
    global _cell
    if _status is not None and _cell:
        _status(f"{_cell}: {msg}", True)
    _cell = ""


class StatusLine:
    """The compact per-cell line on a terminal stream: rewritten in place on a TTY, and only its
    final form (one line per cell) elsewhere."""

    def __init__(self, stream):
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())

    def __call__(self, msg: str, final: bool) -> None:
        if self.tty:
            import shutil

            width = shutil.get_terminal_size().columns
            self.stream.write("\r\033[K" + (msg if final else msg[: max(width - 1, 20)]) + ("\n" if final else ""))
        elif final:
            self.stream.write(msg + "\n")
        self.stream.flush()


_phases: dict[str, float] = {}  # seconds per phase of this run (`phase`), for the part's record


@contextlib.contextmanager
def phase(name: str):
    """Time what the block does as `name` (store build, parity gate, warm-up, timed passes, ...): a log line
    each, and the run's totals (`phase_times`), so a run in parts shows what a part spent outside timed passes."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add_phase_time(name, time.perf_counter() - t0)
        memory = host_memory.host_memory_text()
        progress(f"  time: {name} {time.perf_counter() - t0:.1f} s" + (f" ({memory})" if memory else ""))


def add_phase_time(name: str, seconds: float) -> None:
    _phases[name] = _phases.get(name, 0.0) + seconds


def phase_times() -> dict[str, float]:
    """Seconds per phase since `reset_phases`."""
    return dict(_phases)


def reset_phases() -> None:
    _phases.clear()
