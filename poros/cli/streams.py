"""Standard output and error as the command line writes them (`console_streams`, set once at its entry): text
their encoding cannot hold is written with backslash escapes (`PYTHONIOENCODING=ascii` and an em dash), a reader
that went away (`| head`) ends the output quietly while the command finishes with its own status, and a device
that takes nothing (`> /dev/full`) ends the command in one line on standard error."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from poros.errors import WriteError


class ConsoleStream:
    """A text stream (sys.stdout or sys.stderr, or a log written through them) whose write and flush turn a closed
    reader into silence and any other failure into `WriteError` naming `what` (with `keep_going`, into `failure`,
    which the owner reports when it is done: a run does not stop because its log filled the disk); everything else
    is the stream's own."""

    def __init__(self, stream, what: str, keep_going: bool = False):
        self._stream, self._what, self._keep_going = stream, what, keep_going
        self.gone = False  # the reader went away, or the device failed: later output is dropped
        self.failure: str | None = None  # with keep_going: why the output stopped

    def _drop(self) -> None:
        """Send what the stream still buffers, and everything after, to /dev/null: the interpreter's own flush
        at exit then has nowhere to fail."""
        self.gone = True
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except (OSError, ValueError, AttributeError):  # no file descriptor (a test's capture): nothing buffers
            pass

    def _guard(self, call, *args):
        if self.gone:
            return None
        try:
            return call(*args)
        except BrokenPipeError:
            self._drop()
        except OSError as e:
            self._drop()
            if e.errno == errno.EPIPE:
                return None
            self.failure = f"cannot write {self._what} ({e.strerror or e})"
            if not self._keep_going:
                raise WriteError(self.failure) from None
        return None

    def write(self, text: str) -> int:
        self._guard(self._stream.write, text)
        return len(text)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def close(self) -> None:
        self.gone = False  # what it still holds goes where the descriptor now points
        self._guard(self._stream.close)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _escaping(stream) -> None:
    try:
        stream.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper, or closed: written as it is
        pass


@contextlib.contextmanager
def console_streams():
    """While it lasts, sys.stdout and sys.stderr are `ConsoleStream`s; standard output is flushed inside it, so
    a failure to deliver the last of it is reported like any other."""
    saved = sys.stdout, sys.stderr
    for stream in saved:
        _escaping(stream)
    sys.stdout, sys.stderr = ConsoleStream(saved[0], "to standard output"), ConsoleStream(saved[1], "to standard error")
    try:
        yield
        sys.stdout.flush()
    finally:  # also on the way out of --help's SystemExit: the interpreter's flush at exit finds nothing left
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, ConsoleStream):
                try:
                    stream.flush()
                except WriteError:
                    pass
        sys.stdout, sys.stderr = saved
