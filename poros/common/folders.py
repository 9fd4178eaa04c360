"""Output folders a run owns: created or refused in one line (`ensure_folder`), and held by one run at a
time (`OutputLock`). `poros bench` and `poros train` both write into such folders."""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

from poros.errors import PorosError

LOCK_NAME = ".poros.lock"


class OutputInUse(PorosError):
    """Another run owns the output folder."""


def _describe(holder: dict) -> str:
    cmd = f" ({holder['command']})" if holder.get("command") else ""
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since "
            f"{holder.get('started', '?')}{cmd}")


class OutputLock:
    """Exclusive ownership of an output folder for the lifetime of one run.

    The lock is `OUT/.poros.lock`, held with flock (released by the kernel when its process dies,
    so a killed run leaves a stale file, not a held lock) and naming its holder: pid, host, start
    time and command. Re-entrant within a process: `poros bench` takes it, then its suites do.

    Raises (from `acquire`):
        OutputInUse: naming the run that holds it.
        PorosError: the folder cannot be created or written.
    """

    _held: dict[Path, "OutputLock"] = {}

    def __init__(self, folder, command: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command = command if command is not None else _invocation()
        self.stale: dict | None = None  # the holder a killed run left behind, once taken over
        self._fd: int | None = None
        self._depth = 0
        self._outer: OutputLock | None = None  # the lock this process already holds on the folder

    def _key(self) -> Path:
        return self.folder.resolve()

    def acquire(self) -> "OutputLock":
        held = OutputLock._held.get(self._key())
        if held is not None:
            held._depth += 1
            self._outer = held
            return self
        ensure_folder(self.folder, "output folder")
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise PorosError(f"output folder {self.folder}: cannot create {LOCK_NAME} ({e.strerror}); "
                                 f"pass a writable folder") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise PorosError(f"output folder {self.folder}: cannot lock {LOCK_NAME} ({e.strerror})") from None
                raise OutputInUse(f"output folder {self.folder} is in use by another run: "
                                  f"{_describe(self._read())}; wait for it to end or pass another -o") from None
            try:  # the locked file must still be the one at the path (a releasing run unlinks it)
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _parse_holder(os.pread(fd, 4096, 0))
        if previous and previous.get("host") != socket.gethostname():
            os.close(fd)  # its liveness cannot be told from here
            raise OutputInUse(f"output folder {self.folder} is locked by {_describe(previous)}, another host; "
                              f"if that run has ended, delete {self.path}")
        self.stale = previous  # flock was free: the run that wrote it is gone
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd, self._depth = fd, 1
        OutputLock._held[self._key()] = self
        return self

    def _read(self) -> dict:
        try:
            return _parse_holder(self.path.read_bytes()) or {}
        except OSError:
            return {}

    def release(self) -> None:
        if self._outer is not None:
            self._outer.release()
            self._outer = None
            return
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        OutputLock._held.pop(self._key(), None)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def stale_warning(self) -> str | None:
        if self.stale is None:
            return None
        return (f"warning: {self.path} was left by {_describe(self.stale)}, which is no longer running; "
                f"taking the folder over")

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _invocation() -> str:
    """This process's command line, as typed (`python -m pytest suites/ ...`)."""
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        prog = f"python -m {Path(sys.argv[0]).parent.name}"
    return " ".join([prog, *sys.argv[1:]])


def _parse_holder(raw: bytes) -> dict | None:
    try:
        holder = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def ensure_folder(folder, what: str = "output folder") -> Path:
    """Create `folder` (and its parents) or say in one line why it cannot be.

    Raises:
        PorosError: it is a file, lies under a file, or cannot be created.
    """
    from poros.paths import unreadable

    folder = Path(folder)
    if unreadable(folder) == "is a loop of symbolic links":
        raise PorosError(f"{what} {folder} is a loop of symbolic links; pass a folder")
    if folder.exists() and not folder.is_dir():
        raise PorosError(f"{what} {folder} is a file, expected a folder; pass a folder path")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PorosError(f"{what} {folder}: cannot create it ({e.strerror}); pass a writable folder") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PorosError(f"{what} {folder} is not writable; pass a writable folder")
    return folder
