"""Paths given on the command line that cannot be read as the file or folder they name, refused before
anything reads them: an empty one (`-o ''` would be the current folder), a loop of symbolic links (Python's resolve
raises on it), and a FIFO, socket or device (reading a FIFO that has no writer waits forever)."""

from __future__ import annotations

import argparse
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


def path_arg(text: str) -> str:
    """argparse `type` of every path argument: an empty string names no file (as a path it is the current folder,
    into which a command would write every file it makes)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def resolved(path: str | Path, what: str) -> Path:
    """`path` made absolute with its links followed (`Path.resolve`).

    Raises:
        PorosError: naming `what` and the path, where a loop of symbolic links lies on the way.
    """
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as e:  # Python < 3.13 raises RuntimeError("Symlink loop ..."), later OSError
        if isinstance(e, OSError) and e.errno != errno.ELOOP:
            raise
        raise PorosError(f"{what} {path} is a loop of symbolic links; pass a regular file or folder") from None
