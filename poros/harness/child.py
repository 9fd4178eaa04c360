"""A child process's output, read on a thread of its own while the parent times it: every line goes to the
log as it comes, and the lines that start with a marker become events the timed-pass loop waits on (a
warm-up pass ended, a timed pass ended, the result), so the parent's pytest-benchmark rounds close as the
child's passes do."""

from __future__ import annotations

import json
import queue
import sys
import threading

from poros.harness.console import stop_if_interrupted

EOF_EVENT = "eof"
_DECODER = json.JSONDecoder()


def emit(marker: str, record: dict) -> None:
    """Print a marker line for the parent's `ChildLines`: one write, newline included, so that processes
    sharing the pipe never split it (whether or not stdout is buffered)."""
    sys.stdout.write(marker + json.dumps(record) + "\n")
    sys.stdout.flush()


class ChildLines:
    """Read `proc.stdout` on a daemon thread: lines that carry a marker (`markers`: prefix -> event kind,
    the rest of the line JSON) queue as events, every other line goes to `log` (`show(line)` decides how it reads) and the
    last 30 are kept in `tail`."""

    def __init__(self, proc, markers: dict[str, str], log=print, show=lambda line: line, budget=None,
                 what: str = "the child process"):
        self.proc, self.markers, self.log, self.show = proc, markers, log, show
        self.budget, self.what = budget, what  # a time budget (poros.harness.budget) the waits end at
        self.events: queue.Queue = queue.Queue()
        self.tail: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                event = self._event(line)
                if event is None:
                    self._keep(line)
                else:
                    self.events.put(event)
        finally:
            self.events.put((EOF_EVENT, None))

    def _event(self, line: str) -> tuple[str, dict] | None:
        """The event a line carries, if any. `emit` writes a marker and its newline in one write, but other
        processes sharing the pipe (data-parallel ranks) may have written part of a line of theirs around it:
        that text goes to the log as lines of its own."""
        for prefix, kind in self.markers.items():
            at = line.find(prefix)
            if at >= 0:
                payload, end = _DECODER.raw_decode(line, at + len(prefix))
                for text in (line[:at], line[end:]):
                    if text.strip():
                        self._keep(text)
                return kind, payload
        return None

    def _keep(self, line: str) -> None:
        self.tail = (self.tail + [line.rstrip()])[-30:]
        self.log(self.show(line.rstrip()))

    def next(self) -> tuple[str, dict | None]:
        """The next event, waiting for it (a Ctrl-C the bench caught, or the time budget running out, still stops
        the wait: KeyboardInterrupt, OutOfTime): (kind, payload), or (`EOF_EVENT`, None) once the child has closed
        its output."""
        while True:
            try:
                return self.events.get(timeout=0.2)
            except queue.Empty:
                stop_if_interrupted()
                if self.budget is not None and self.budget.expired():
                    from poros.harness.budget import OutOfTime

                    raise OutOfTime(f"{self.what} was stopped at the budget") from None

    def join(self) -> None:
        """Wait until every line the child printed has been read."""
        self._thread.join()
