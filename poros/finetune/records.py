"""The records of a `poros train` data file, read one line (or table row) at a time and checked.

A data file is JSON Lines, plain or gzip-compressed (told by its first bytes, whatever its name),
UTF-8 text; or a table the `datasets` library reads (poros.finetune.tables). A record is
`{"text": "..."}`, `{"prompt": "...", "completion": "..."}` (loss on the completion only) or
`{"messages": [{"role", "content"}, ...]}`; other keys are ignored. Roles are
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
    completion: int = 0  # prompt-completion records
    mapped: Counter = field(default_factory=Counter)  # (spelling, role) -> turns

    @property
    def records(self) -> int:
        return self.text + self.chat + self.completion

    def kinds(self) -> str:
        """`60 text, 40 chat` (prompt-completion records named where there are any)."""
        return f"{self.text:,} text, {self.chat:,} chat" + (
            f", {self.completion:,} prompt-completion" if self.completion else "")

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
            raise DataError(f"{self.path} is a folder with no Parquet or Arrow files and no save_to_disk output; "
                            "expected a JSON Lines file (.jsonl or .jsonl.gz) or such a folder")
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such data file")
        self.size = self.path.stat().st_size
        self._raw = None

    @property
    def position(self) -> int:
        """Bytes of the file (compressed, for gzip) read so far."""
        return self._raw.tell() if self._raw is not None and not self._raw.closed else self.size

    def where(self, n: int) -> str:
        return f"{self.path}:{n}"

    def progress(self) -> str:
        """How far through the file reading is, for a progress line."""
        return f"{100 * self.position / max(self.size, 1):.0f}% ({_size(self.position)} of {_size(self.size)})"

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


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def records(path: str | Path, counts: RecordCounts | None = None, reader=None) -> Iterator[tuple[int, dict]]:
    """Every record of a data file with its line (or row) number, checked and with its roles mapped;
    blank lines are skipped. `counts` (if given) is updated as records are read. `reader`: a
    LineReader (default) or a poros.finetune.tables.TableReader, which yields rows as dicts.

    Raises:
        DataError: naming the file and line of the first bad record, or an empty file.
    """
    reader = reader or LineReader(path)
    counts = counts if counts is not None else RecordCounts()
    for n, line in reader:
        if isinstance(line, dict):  # a table's row: its empty columns are absent
            rec = {k: v for k, v in line.items() if v is not None}
        elif not line.strip():
            continue
        else:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{reader.path}:{n}: not JSON ({e.msg} at column {e.colno}); expected one JSON "
                                'object per line, e.g. {"text": "..."}') from None
        rec = check_record(rec, reader.where(n), counts)
        yield n, rec
    if not counts.records:
        raise DataError(f"{reader.path}: no records (the file is empty); expected JSON Lines with "
                        '{"text": ...}, {"prompt": ..., "completion": ...} or {"messages": [...]} per line')


def read_records(path: str | Path) -> list[dict]:
    """Every record of a data file, in a list (small files; training streams them)."""
    return [rec for _, rec in records(path)]


def check_record(rec, where: str, counts: RecordCounts) -> dict:
    """`rec` checked, its roles mapped to the known ones; counts the record by kind."""
    kinds = [k for k in ("text", "messages", "prompt") if isinstance(rec, dict) and k in rec]
    if len(kinds) != 1 or (isinstance(rec, dict) and ("prompt" in rec) != ("completion" in rec)):
        got = f"keys {sorted(map(str, rec))}" if isinstance(rec, dict) else type(rec).__name__
        raise DataError(f'{where}: expected an object with one of "text", "messages", or "prompt" and "completion", '
                        f"got {got}")
    if "prompt" in rec:
        for k in ("prompt", "completion"):
            _check_text(rec[k], k, where)
        counts.completion += 1
        return rec
    if "text" in rec:
        _check_text(rec["text"], "text", where)
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
        if _lone_surrogate(m["content"]):
            raise DataError(f"{where}: message {i}'s content holds a lone surrogate escape (e.g. \\ud800 without its "
                            "pair), which is no character; fix the escape or drop it")
        role = _known_role(m["role"], where, i)
        if role != m["role"]:
            counts.mapped[(m["role"], role)] += 1
            m = {**m, "role": role}
        turns.append(m)
    counts.chat += 1
    return {**rec, "messages": turns}


def _check_text(v, key: str, where: str) -> None:
    """A record's text: a string of more than whitespace (nothing to learn from otherwise), all characters."""
    if not isinstance(v, str) or not v.strip():
        got = "only whitespace" if isinstance(v, str) and v else f"{v!r:.60}"
        raise DataError(f'{where}: "{key}" must be a string of more than whitespace, got {got}')
    if _lone_surrogate(v):
        raise DataError(f'{where}: "{key}" holds a lone surrogate escape (e.g. \\ud800 without its pair), which is '
                        "no character; fix the escape or drop it")


def _lone_surrogate(text: str) -> bool:
    """JSON's \\uXXXX escapes may name half of a UTF-16 pair alone; no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _known_role(role: str, where: str, turn: int) -> str:
    low = role.strip().lower()
    if low in ROLES:
        return low
    if low in ROLE_ALIASES:
        return ROLE_ALIASES[low]
    raise DataError(f"{where}: message {turn} has role {role!r}, which the chat template does not know; use one of "
                    f"{', '.join(ROLES)} (also read: {', '.join(ROLE_ALIASES)}, in any case)")
