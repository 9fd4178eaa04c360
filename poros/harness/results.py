"""Results files and output folders: nothing lost, nothing mixed.

An output folder is owned by one run at a time (`poros.common.folders.OutputLock`); the files of an earlier run are
moved into `OUT/earlier/N/` before a new run starts (`keep_earlier`), never overwritten; rows are
appended one whole line per write and synced, or not at all (`ResultsWriter`, through
`poros.common.atomic.append_line`), and a line torn by a killed run is set aside, with a warning, before anything is
appended after it (`ResultsWriter.repair`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from poros.common.atomic import append_line, write_atomic
from poros.errors import PorosError
from poros.paths import unreadable
from poros.harness.record_schema import one_line, parse_line, pass_problems, row_problems

EARLIER = "earlier"
# what one `poros bench matrix` run writes into its output folder (gate-references/: a gate's reference side kept as
# digests, named by the pass log beside it: the two move together; matrix.yaml: the matrix the run measured)
RUN_FILES = ("results.jsonl", "results.jsonl.torn", "passes.jsonl", "passes.jsonl.torn", "benchmark.json",
             "bench.log", "report.md", "report.png", "matrix.yaml", "gate-references")


class ResultsFileError(PorosError):
    """A results file cannot be read or appended to as it is."""


def keep_earlier(folder, names=RUN_FILES) -> tuple[Path | None, list[str]]:
    """Move the files among `names` that exist in `folder` into a new `folder/earlier/N/`.

    Returns:
        The new folder and the names moved (None and [] when there was nothing to keep).
    """
    folder = Path(folder)
    present = [n for n in names if (folder / n).exists()]
    if not present:
        return None, []
    base = folder / EARLIER
    if base.exists() and not base.is_dir():
        raise PorosError(f"{base} is a file: it is where earlier runs' files are kept; move it away")
    base.mkdir(exist_ok=True)
    numbers = [int(p.name) for p in base.iterdir() if p.name.isdigit()]
    n = max(numbers, default=0) + 1
    while True:
        target = base / str(n)
        try:
            target.mkdir()  # exclusive: never reuses (or writes into) an earlier run's folder
            break
        except FileExistsError:
            n += 1
    for name in present:
        os.replace(folder / name, target / name)
    return target, present


class ResultsWriter:
    """Appends one JSON object per cell, each as one write of a whole line, synced, so a killed
    run keeps every finished cell; reads each back checked against its schema (`check`: results rows by default,
    `poros.harness.record_schema`)."""

    def __init__(self, path: Path, check=row_problems):
        self.path = Path(path)
        self.check = check
        self.last: dict | None = None  # the row most recently appended by this writer

    def _text(self) -> str:
        try:
            return self.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ResultsFileError(f"{self.path}: not a results file (byte {e.start} is not UTF-8 text); "
                                   f"pass the results.jsonl a poros run wrote, or another -o") from None
        except IsADirectoryError:
            raise ResultsFileError(f"{self.path} is a folder, expected a results file (JSON Lines)") from None

    def _parse(self, text: str) -> tuple[list[dict], int | None]:
        """The complete rows, and the index of a torn last line (None when there is none).

        Raises:
            ResultsFileError: a line other than the last is not a JSON object, or a line's record does not fit
                its schema (naming the file, the line and the field).
        """
        lines = text.split("\n")
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            row = _row(line)
            if row is None:
                if i == last:
                    return rows, i
                raise ResultsFileError(f"{self.path}:{i + 1}: not a results row (JSON object); the file was "
                                       f"edited or mixed with another: fix or delete that line, or pass another -o")
            problems = self.check(row)
            if problems:
                raise ResultsFileError(f"{self.path}:{i + 1}: {one_line(problems)}; the line was edited or damaged: "
                                       f"fix or delete it (poros writes every line), or pass another -o")
            rows.append(row)
        return rows, None

    def _present(self) -> bool:
        """Whether the file exists to be read (a missing one holds no rows).

        Raises:
            ResultsFileError: the path is a folder, a FIFO (reading one with no writer waits forever), a socket, a
                device or a loop of symbolic links: never read as "no rows yet".
        """
        why = unreadable(self.path)
        if why is None and self.path.is_dir():
            why = "is a folder"
        if why is not None:
            raise ResultsFileError(f"{self.path} {why}, expected a results file (JSON Lines); remove it or pass "
                                   f"another -o")
        return self.path.is_file()

    def rows(self) -> list[dict]:
        """Every complete row (a torn last line is left out; `repair` sets it aside)."""
        if not self._present():
            return []
        return self._parse(self._text())[0]

    def repair(self) -> str | None:
        """Before appending to an existing file: move a torn last line into `<file>.torn` and end
        the file on a newline. Returns the warning to show, or None when nothing was torn.

        Raises:
            ResultsFileError: the file is not UTF-8 text or has a malformed line before the last.
        """
        if not self._present():
            return None
        text = self._text()
        rows, torn = self._parse(text)
        if torn is None:
            if text and not text.endswith("\n"):  # a whole last row whose newline was cut off
                self._write_raw(b"\n")
            return None
        lines = text.split("\n")
        side = self.path.with_name(self.path.name + ".torn")
        append_line(side, lines[torn].encode() + b"\n", "the partial row aside to")
        kept = "\n".join(lines[:torn])
        write_atomic(self.path, (kept + "\n" if kept else "").encode(), "the complete rows of")
        return (f"warning: {self.path}:{torn + 1} is a partial row (a run was cut off while writing it): kept "
                f"the {len(rows)} complete rows and moved the partial line to {side}")

    def done(self, matrix: str, timed: bool = True) -> dict[tuple, dict]:
        """The finished cells of `matrix` by `row_key`, each its latest row; with `timed`, only rows that hold a
        timing (a run under --benchmark-disable records gates, not timings). A cell whose latest row failed, or
        failed its parity gate, is not finished: `--resume` runs it (and its gate) again."""
        latest = {row_key(r): r for r in self.rows() if r.get("matrix") == matrix}
        return {k: r for k, r in latest.items() if finished(r) and (not timed or r.get("timed", True))}

    def _write_raw(self, data: bytes) -> None:
        """Append `data` whole or not at all (`append_line`): every complete row stays as it was.

        Raises:
            WriteError: naming the file and why the write failed.
        """
        append_line(self.path, data, "a row to", "every complete row is kept; --resume continues once there is room")

    def append(self, row: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_raw((json.dumps(row) + "\n").encode())
        self.last = row


def finished(row: dict) -> bool:
    """Whether a results row finishes its cell: it ran (status ok) and passed its gate, or took part in none."""
    return row.get("status") == "ok" and row.get("parity") != "FAIL"


def show_value(v) -> str:
    """A setting's value as cell ids and row keys write it (no spaces: ids are selected with -k)."""
    if isinstance(v, (list, tuple)):
        return "+".join(map(show_value, v))
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(getattr(v, "value", v)).replace(" ", "")


def point_id(point) -> str:
    """A sweep point (mapping or pairs) as `seq_len:512-grad_accum:8` ('' without a sweep)."""
    items = point.items() if isinstance(point, dict) else point
    return "-".join(f"{k}:{show_value(v)}" for k, v in items)


def row_key(row: dict) -> tuple:
    """The cell a results row belongs to, as `Cell.key` (rows from before sweeps and plans: none of either)."""
    sweep = row.get("sweep") if isinstance(row.get("sweep"), dict) else {}
    return (row.get("model"), row.get("stack_name"), row.get("method"), row.get("plan_name"), point_id(sweep))


def passes_path(results) -> Path:
    """Where a run keeps the passes of cells it has not finished: `passes.jsonl` beside the results."""
    return Path(results).with_name("passes.jsonl")


class PassLog:
    """What a cell has done before its row is written: each timed pass (`kind: pass`), each gate outcome
    (`kind: gate`) and each gate reference kept as digests (`kind: reference`), one whole line each, keyed
    by the cell and a fingerprint of everything it runs with, so a killed or budgeted run loses at most the
    pass (or the side of a gate) it was in and `--resume` continues the cell where it stopped."""

    def __init__(self, path, process: dict | None = None):
        self.writer = ResultsWriter(path, check=pass_problems)
        self.process = process  # where this process's records come from ({host, pid, started}), named in each

    def _records(self, kind: str, cell: str, fingerprint: str) -> list[dict]:
        return [r for r in self.writer.rows()
                if r.get("kind") == kind and r.get("cell") == cell and r.get("fingerprint") == fingerprint]

    def records(self) -> list[dict]:
        """Every record, passes, gate outcomes and parts alike."""
        return self.writer.rows()

    def passes(self, cell: str, fingerprint: str, count: int | None = None) -> list[dict]:
        """The timed passes recorded for `cell`: passes 0, 1, ... in order, each once (its first record), up to
        the first index missing and below `count` (the passes the cell times); records past those (an index
        beyond the passes, a second record of one, one after a gap) count for nothing: `ignored_passes` names
        them."""
        return self._pass_records(cell, fingerprint, count)[0]

    def ignored_passes(self, cell: str, fingerprint: str, count: int | None = None) -> list[str]:
        """Why each pass record of `cell` that `passes` leaves out is left out, one line each."""
        return self._pass_records(cell, fingerprint, count)[1]

    def _pass_records(self, cell: str, fingerprint: str, count: int | None) -> tuple[list[dict], list[str]]:
        kept: dict[int, dict] = {}
        ignored = []
        for r in self._records("pass", cell, fingerprint):
            i = r["index"]
            if count is not None and i >= count:
                ignored.append(f"pass index {i} is beyond the cell's {count} passes (0 to {count - 1})")
            elif i in kept:
                ignored.append(f"pass {i} is recorded again ({r['seconds']:g} s); its first record counts")
            else:
                kept[i] = r
        ordered = []
        while len(ordered) in kept:
            ordered.append(kept[len(ordered)])
        ignored += [f"pass {i} follows a pass never recorded ({len(ordered)})" for i in sorted(kept) if i > len(ordered)]
        return ordered, [f"{self.writer.path}: {cell}: {why}" for why in ignored]

    def gate(self, cell: str, fingerprint: str) -> dict | None:
        found = self._records("gate", cell, fingerprint)
        return found[-1]["result"] if found else None

    def reference(self, cell: str, fingerprint: str) -> dict | None:
        """The record of a gate reference's states kept as digests (`kind: reference`), or None."""
        found = self._records("reference", cell, fingerprint)
        return found[-1] if found else None

    def add(self, kind: str, cell: str, fingerprint: str, **record) -> None:
        from poros.provenance import current_commit

        head = {"kind": kind, "cell": cell, "fingerprint": fingerprint, "commit": current_commit()}
        if self.process is not None:
            head["process"] = self.process
        self.writer.append({**head, **record})


def _row(line: str) -> dict | None:
    try:
        row = parse_line(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None
