"""Every file Poros writes goes through here: written whole under a temporary name in the same folder, synced, then
renamed over its target (`write_atomic`; `atomic_path` for writers that take a path, such as matplotlib's or
safetensors'; `atomic_folder` for a folder of files), or, for JSON Lines, appended as one whole line or not at all
(`append_line`). A write that fails (a full disk, a file-size limit, a read-only folder) leaves the target as it was
and no temporary behind, and is one line naming what could not be written and where (`WriteError`)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from poros.errors import WriteError

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk or quota, a file-size limit
# what to do, by the reason a write failed
ADVICE = {errno.ENOSPC: "free space", errno.EDQUOT: "free space (the disk quota is full)",
          errno.EFBIG: "raise the file-size limit (ulimit -f)", errno.EROFS: "pass a writable folder",
          errno.EACCES: "pass a writable folder", errno.EPERM: "pass a writable folder"}


def reason_of(e: BaseException) -> tuple[str, int | None]:
    """Why a write failed, in words, and its errno where known. safetensors' writer raises its own error around
    Rust's I/O error (`Error while serializing: I/O error: File too large (os error 27)`)."""
    if isinstance(e, OSError):
        return e.strerror or str(e), e.errno
    text = str(e)
    rust = re.search(r"I/O error: (.*?) \(os error (\d+)\)", text) or \
        re.search(r'IoError\(Os \{ code: (\d+), .*message: "([^"]*)"', text)
    if rust is None:
        return text.splitlines()[0] if text else type(e).__name__, None
    if rust.re.pattern.startswith("IoError"):
        return rust.group(2), int(rust.group(1))
    return rust.group(1), int(rust.group(2))


def is_write_failure(e: BaseException) -> bool:
    """An OSError, or safetensors' error around one (it is not an OSError)."""
    return isinstance(e, OSError) or type(e).__name__ == "SafetensorError" and reason_of(e)[1] is not None


def write_failure(what: str, path, e: BaseException, then: str = "") -> WriteError:
    """The one line a failed write is: `cannot write WHAT PATH (REASON); ADVICE[; THEN]`."""
    reason, number = reason_of(e)
    advice = ADVICE.get(number, "check the folder and free space")
    error = WriteError(f"cannot write {what} {path} ({reason}); {advice}" + (f"; {then}" if then else ""))
    error.reason = reason
    return error


def written_why(e: BaseException) -> str:
    """Why a write failed, in words: a `WriteError`'s reason, an OSError's (or safetensors') own."""
    return getattr(e, "reason", None) or reason_of(e)[0]


def _temporary(path: Path) -> Path:
    """A hidden name beside `path` that keeps its suffix (writers choose their format by it) and says it is partial."""
    return path.with_name(f".{path.stem}.{os.getpid()}.partial{path.suffix}")


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # a filesystem that cannot sync folders still renamed
        _sync(folder)


@contextlib.contextmanager
def atomic_path(path, what: str = "file", then: str = ""):
    """Yield a temporary path beside `path` for a writer to write the whole file to; once it has, the file is
    synced and renamed over `path`. `path` holds the old file or the new, never part of one.

    Raises:
        WriteError: the write, the sync or the rename failed (the temporary is removed; `then` is appended to the
            line: what is kept, what to run next).
    """
    path = Path(path)
    tmp = _temporary(path)
    try:
        yield tmp
        _sync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_write_failure(e):
            raise write_failure(what, path, e, then) from None
        raise
    _sync_folder(path.parent)


def write_atomic(path, data: str | bytes, what: str = "file", then: str = "") -> None:
    """Write `data` (text as UTF-8) to `path` whole (`atomic_path`).

    Raises:
        WriteError: naming `what` and `path`.
    """
    blob = data.encode() if isinstance(data, str) else data
    with atomic_path(path, what, then) as tmp, open(tmp, "wb") as f:
        f.write(blob)


def _alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _abandoned(folder: Path) -> list[Path]:
    """The temporary folders beside `folder` that no running process fills: those of writers killed before they could
    remove them (SIGKILL, a lost machine), a whole checkpoint's size each, and this process's own."""
    pattern = re.compile(rf"\.{re.escape(folder.name)}\.(\d+)\.partial")
    if not folder.parent.is_dir():
        return []
    return [p for p in folder.parent.iterdir()
            if (m := pattern.fullmatch(p.name)) and p.is_dir()
            and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1))))]


@contextlib.contextmanager
def atomic_folder(folder, what: str = "folder", then: str = ""):
    """Yield a temporary folder beside `folder` to fill; once filled, it is renamed to `folder` (which must be
    absent or empty). A failure removes the temporary folder; one that a killed writer left is removed first.

    Raises:
        WriteError: a write into it or the rename failed.
    """
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    for stale in _abandoned(folder):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                _sync(f)
        if folder.exists():
            folder.rmdir()  # an empty folder the caller checked
        tmp.rename(folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise write_failure(what, folder, e, then) from None
        raise
    _sync_folder(folder.parent)


def append_line(path, data: bytes, what: str = "row", then: str = "") -> None:
    """Append `data` (whole lines) to `path` whole or not at all: a short or failed write (a full disk, a file-size
    limit) is cut back off the file, so every complete line stays as it was.

    Raises:
        WriteError: naming `what`, the file and why.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_failure(what, path, e, then) from None
    try:
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):  # a short write: the disk filled, or the file reached its size limit,
                n = os.write(fd, data[written:])  # within it; writing the rest then fails with the reason
                if n == 0:
                    raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes were written")
                written += n
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise write_failure(what, path, e, then) from None
    finally:
        os.close(fd)
