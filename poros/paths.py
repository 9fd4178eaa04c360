"""Paths given on the command line that cannot be read as the file or folder they name, refused before
anything reads them: a loop of symbolic links (Python's resolve raises on it), and a FIFO, socket or device
(reading a FIFO that has no writer waits forever)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from poros.errors import PorosError

KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"))


def unreadable(path: str | Path) -> str | None:
    """Why `path` is no file or folder to read (None: it is one, or it is missing, which its reader says)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return "is a loop of symbolic links" if e.errno == errno.ELOOP else None
    return next((f"is {kind}, not a file" for test, kind in KINDS if test(mode)), None)


def check_input(path: str | Path, what: str) -> None:
    """Raises: PorosError naming `what` (e.g. `--data`) and the path, where `unreadable` says why."""
    why = unreadable(path)
    if why:
        raise PorosError(f"{what} {path} {why}; pass a regular file or folder")
