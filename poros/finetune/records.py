"""The records of a `poros train` data file, read one line at a time and checked.

A data file is JSON Lines, plain or gzip-compressed (told by its first bytes, whatever its name),
UTF-8 text. A record is `{"text": "..."}` or `{"messages": [{"role", "content"}, ...]}`. Roles are
those chat templates know (system, user, assistant, tool); common other spellings (`Assistant`,
`gpt`, `bot`, `human`, ...) are mapped to them and the mapping is reported once per file; any other
role is refused naming its file and line, since a turn the loss cannot place would drop silently.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from poros.errors import PorosError

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant",
                "chatgpt": "assistant", "ai": "assistant", "function": "tool", "ipython": "tool"}
GZIP_MAGIC = b"\x1f\x8b"


class DataError(PorosError):
    """A data file is empty, malformed or too small for the run."""


@dataclass
class RecordCounts:
    """What a data file held: records by kind, and the role spellings mapped to the known roles."""

    text: int = 0
    chat: int = 0
    mapped: Counter = field(default_factory=Counter)  # (spelling, role) -> turns

    @property
    def records(self) -> int:
        return self.text + self.chat

    def mapping(self) -> str | None:
        """The role spellings mapped, in one phrase (None when there were none)."""
        if not self.mapped:
            return None
        return "roles mapped: " + ", ".join(f"{a!r} -> {b} ({n} turns)" for (a, b), n in sorted(self.mapped.items()))


class LineReader:
    """The lines of a data file as (line number, text), with how far through the file it is.

    Raises (while iterating):
        DataError: the file is missing, a folder, a broken gzip stream, or a line not UTF-8.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_dir():
            raise DataError(f"{self.path} is a folder; expected a JSON Lines file (.jsonl or .jsonl.gz)")
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such data file")
        self.size = self.path.stat().st_size
        self._raw = None

    @property
    def position(self) -> int:
        """Bytes of the file (compressed, for gzip) read so far."""
        return self._raw.tell() if self._raw is not None and not self._raw.closed else self.size

    def __iter__(self) -> Iterator[tuple[int, str]]:
        with self.path.open("rb") as raw:
            self._raw = raw
            compressed = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            lines = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
            n = 0
            try:
                for n, line in enumerate(lines, 1):
                    try:
                        yield n, line.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(f"{self.path}:{n}: not UTF-8 text (byte 0x{line[e.start]:02x} at column "
                                        f"{e.start + 1}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                                        ) from None
            except (OSError, EOFError, zlib.error) as e:
                if not compressed or isinstance(e, DataError):
                    raise
                raise DataError(f"{self.path}: the gzip stream is broken after line {n} ({e}); compress the file "
                                "again") from None


def records(path: str | Path, counts: RecordCounts | None = None,
            reader: LineReader | None = None) -> Iterator[tuple[int, dict]]:
    """Every record of a data file with its line number, checked and with its roles mapped; blank
    lines are skipped. `counts` (if given) is updated as records are read.

    Raises:
        DataError: naming the file and line of the first bad record, or an empty file.
    """
    reader = reader or LineReader(path)
    counts = counts if counts is not None else RecordCounts()
    for n, line in reader:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{reader.path}:{n}: not JSON ({e.msg} at column {e.colno}); expected one JSON object "
                            'per line, e.g. {"text": "..."}') from None
        rec = check_record(rec, f"{reader.path}:{n}", counts)
        yield n, rec
    if not counts.records:
        raise DataError(f"{reader.path}: no records (the file is empty); expected JSON Lines with "
                        '{"text": ...} or {"messages": [...]} per line')


def read_records(path: str | Path) -> list[dict]:
    """Every record of a data file, in a list (small files; training streams them)."""
    return [rec for _, rec in records(path)]


def check_record(rec, where: str, counts: RecordCounts) -> dict:
    """`rec` checked, its roles mapped to the known ones; counts the record by kind."""
    if not isinstance(rec, dict) or ("text" in rec) == ("messages" in rec):
        got = f"keys {sorted(rec)}" if isinstance(rec, dict) else type(rec).__name__
        raise DataError(f'{where}: expected an object with either "text" or "messages", got {got}')
    if "text" in rec:
        if not isinstance(rec["text"], str) or not rec["text"]:
            raise DataError(f'{where}: "text" must be a non-empty string, got {rec["text"]!r:.60}')
        counts.text += 1
        return rec
    msgs = rec["messages"]
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
    if not ok:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}, '
                        f"got {msgs!r:.60}")
    turns = []
    for i, m in enumerate(msgs):
        role = _known_role(m["role"], where, i)
        if role != m["role"]:
            counts.mapped[(m["role"], role)] += 1
            m = {**m, "role": role}
        turns.append(m)
    counts.chat += 1
    return {**rec, "messages": turns}


def _known_role(role: str, where: str, turn: int) -> str:
    low = role.strip().lower()
    if low in ROLES:
        return low
    if low in ROLE_ALIASES:
        return ROLE_ALIASES[low]
    raise DataError(f"{where}: message {turn} has role {role!r}, which the chat template does not know; use one of "
                    f"{', '.join(ROLES)} (also read: {', '.join(ROLE_ALIASES)}, in any case)")
