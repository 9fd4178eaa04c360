"""The schema of every record the harness writes and reads back: results rows (`results.jsonl`, what `poros report`
and `--resume` read) and the pass log's records (`passes.jsonl`: each timed pass, gate outcome, gate reference kept
as digests and part of a run in parts). Every reader checks each record here, so a record edited or damaged by hand
is refused in one line naming the file, the line and the field, never met later as a traceback.

A field a record lacks reads as absent (rows and pass records of an earlier harness predate some fields); a field
it holds must be of its kind. Free of torch: `poros report` and `poros bench status` import it.
"""

from __future__ import annotations

import json
import math

from poros.engine.methods.method_info import NAMES

STATUSES = ("ok", "failed", "skipped")
PASS_KINDS = ("pass", "gate", "reference", "part")


# --- field kinds: each returns None where the value is of its kind, else what it expected --------------------------

def _number(v, *, finite: bool = False, least: float | None = None) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if finite and not math.isfinite(v):
        return False
    return least is None or v >= least


def number(v):
    return None if v is None or _number(v) else "a number or null"


def difference(v):
    """A largest difference a gate found: >= 0, infinity where a side held no finite value; NaN says nothing."""
    return None if v is None or _number(v, least=0) and not math.isnan(v) else "a number >= 0 (or Infinity) or null"


def seconds(v):
    """A duration: finite and >= 0 (NaN, infinity or a negative time is no measurement)."""
    return None if v is None or _number(v, finite=True, least=0) else "a finite number of seconds >= 0 or null"


LAST_TIME = 253402300799  # 9999-12-31 23:59:59 UTC: the last moment a page can print as a date


def epoch(v):
    """A moment, in seconds since the epoch, that a page prints as a date: from 1970 to the year 9999."""
    if v is None or _number(v, finite=True, least=0) and v <= LAST_TIME:
        return None
    return "seconds since the epoch (0 to 253402300799, the year 9999) or null"


def pass_seconds(v):
    """A timed pass's seconds: always present, finite and >= 0."""
    return None if _number(v, finite=True, least=0) else "a finite number of seconds >= 0"


def figure(v):
    """A measured figure that a page prints (a size, a spread, a share): finite and >= 0."""
    if v is None or _number(v, finite=True, least=0):
        return None
    return "a number or null" if not _number(v) else "a finite number >= 0 or null"


def measure(v):
    """A measured time or rate whose ratio is a page's claim: finite and > 0 (JSON admits NaN and Infinity; a NaN
    would read as "not run", a zero or negative time as a speed-up)."""
    if v is None or (_number(v, finite=True) and v > 0):
        return None
    return "a number or null" if not _number(v) else "a positive finite number or null"


def whole(least: int):
    """A count a row's protocol is made of (steps, passes, warm-up passes): an integer >= `least`."""
    def check(v):
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            return None
        return f"an integer >= {least} or null"
    return check


def count(v):
    return None if v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) else "an integer >= 0 or null"


def index(v):
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "an integer >= 0"


def text(v):
    return None if isinstance(v, str) else "text"


def text_or_null(v):
    return None if v is None or isinstance(v, str) else "text or null"


def flag(v):
    return None if v is None or isinstance(v, bool) else "true, false or null"


def mapping(v):
    return None if isinstance(v, dict) else "a mapping"


def mapping_or_null(v):
    return None if v is None or isinstance(v, dict) else "a mapping or null"


def one_of(*choices):
    def check(v):
        return None if v in choices else " or ".join(map(str, choices)).replace("None", "null")
    return check


def list_of(kind, what: str):
    def check(v):
        if v is None:
            return None
        if not isinstance(v, list) or any(kind(x) is not None for x in v):
            return f"a list of {what}"
        return None
    return check


def phases(v):
    """A part's seconds per phase: {name: seconds}."""
    if v is None:
        return None
    if not isinstance(v, dict) or any(not isinstance(k, str) or seconds(x) is not None or x is None for k, x in v.items()):
        return "a mapping of phase name to seconds"
    return None


def config(v):
    """A row's settings: a mapping whose every setting the settings table knows holds a value of that setting (the
    report reads each through it); a key it does not know (a setting of an earlier harness) is left alone."""
    if not isinstance(v, dict):
        return "a mapping"
    from poros.settings import SETTINGS

    known = {s.name: s for s in SETTINGS}
    for name, value in v.items():
        if value is not None and name in known:
            try:
                known[name].value(value)
            except (ValueError, TypeError) as e:
                return f"a mapping of settings (its {name}: {e})"
    return None


PROVENANCE_PARTS = {"gpus": "a list of mappings", "versions": "a mapping", "git": "a mapping"}


def provenance(v):
    """Where a row ran: a mapping, whose parts the pages read (gpus, versions, git) of their kinds where present."""
    if not isinstance(v, dict):
        return "a mapping"
    for name, want in PROVENANCE_PARTS.items():
        part = v.get(name)
        ok = part is None or (isinstance(part, dict) if want == "a mapping" else
                              isinstance(part, list) and all(isinstance(g, dict) for g in part))
        if not ok:
            return f"a mapping (its {name}: expected {want}, got {_shown(part)})"
    return None


def process(v):
    """The process a record was written by: {host, pid, started}."""
    if v is None:
        return None
    if not isinstance(v, dict) or text(v.get("host")) or index(v.get("pid")) or epoch(v.get("started")):
        return "a mapping of host (text), pid (an integer) and started (seconds since the epoch)"
    return None


# --- the schemas: field -> kind; REQUIRED fields must be present ----------------------------------------------------

ROW_REQUIRED = ("matrix", "model", "stack", "method", "arch", "status", "steps", "passes", "warmup_passes", "reduced",
                "s_per_step_median", "s_per_step_std", "peak_vram_gb", "parity", "parity_max_abs_diff",
                "bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "tokens_per_s", "config", "provenance")
ROW_FIELDS = {
    "matrix": text, "model": text, "stack": text, "arch": text,
    "method": one_of(*NAMES), "status": one_of(*STATUSES),
    "steps": whole(1), "passes": whole(1), "warmup_passes": whole(0),
    "s_per_step_median": measure, "s_per_step_std": figure, "peak_vram_gb": figure,
    "parity_max_abs_diff": difference, "bytes_h2d_per_step": figure, "copy_gbps": measure, "copy_hidden_share": figure,
    "tokens_per_s": measure, "link_h2d_gbps": measure, "copy_floor_s": measure,
    "load_avg_max": figure, "cores": whole(1), "held_before_gb": figure,
    "config": config, "provenance": provenance,
    "parity": one_of("PASS", "FAIL", None),
    "plan_name": text_or_null, "sweep": mapping_or_null, "timed": flag,
    "per_pass_s": list_of(lambda v: measure(v) if v is not None else "seconds", "positive finite seconds"),
    "pass_gpus": list_of(text_or_null, "GPU UUIDs or null"),
}

PASS_FIELDS = {  # every kind of pass-log record
    "kind": one_of(*PASS_KINDS), "cell": text, "fingerprint": text, "commit": text_or_null, "process": process,
}
PASS_KIND_FIELDS = {
    "pass": ({"index": index, "seconds": pass_seconds,
              "counters": list_of(mapping, "mappings"), "alloc_retries": count, "gpu": text_or_null,
              "peak_vram_gb": figure, "peak_reserved_gb": figure, "peak_vram_nvml_gb": figure, "load_avg": figure,
              "overhead_s": number, "child_overhead_s": number},
             ("index", "seconds")),
    "gate": ({"result": lambda v: gate_result(v), "seconds": seconds}, ("result",)),
    "reference": ({"file": text, "seconds": seconds, "checksum": text_or_null}, ("file",)),
    "part": ({"part_id": text_or_null, "started": epoch, "ended": epoch, "wall_s": seconds, "phases": phases,
              "exit_status": lambda v: None if v is None or (isinstance(v, int) and not isinstance(v, bool))
              else "an integer or null", "stopped": flag, "gpu": list_of(text_or_null, "GPU UUIDs"),
              "max_minutes": measure, "passes_per_part": whole(1), "steps": whole(1), "passes": whole(1)},
             ()),
}

GATE_FIELDS = {"parity": one_of("PASS", "FAIL"), "steps": count, "tensors_compared": count,
               "first_mismatch": text_or_null, "max_abs_diff": number}


def gate_result(v):
    """A gate outcome as `ParityResult` writes it."""
    if not isinstance(v, dict):
        return "a gate outcome (a mapping with parity, steps, tensors_compared, first_mismatch, max_abs_diff)"
    for name, kind in GATE_FIELDS.items():
        if name not in v:
            return f"a gate outcome (its {name}: missing)"
        if kind(v[name]) is not None:
            return f"a gate outcome (its {name}: {kind(v[name])}, got {_shown(v[name])})"
    return None


def _problems(record: dict, fields: dict, required=()) -> list[str]:
    out = [f"field {k}: missing" for k in required if k not in record]
    for name, kind in fields.items():
        if name in record:
            want = kind(record[name])
            if want is not None:
                out.append(f"field {name}: expected {want}, got {_shown(record[name])}")
    return out


def _shown(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def row_problems(row) -> list[str]:
    """What a results row holds that the harness cannot use: each names the field, what it expected and what came
    in (empty where the row is whole)."""
    if not isinstance(row, dict):
        return [f"expected a JSON object (a results row), got {type(row).__name__}"]
    missing = [k for k in ROW_REQUIRED if k not in row]
    if missing:
        return [f"missing key(s) {', '.join(missing)}"]
    return _problems(row, ROW_FIELDS)


def pass_problems(record) -> list[str]:
    """What a pass-log record holds that the harness cannot use (empty where it is whole)."""
    if not isinstance(record, dict):
        return [f"expected a JSON object (a pass-log record), got {type(record).__name__}"]
    out = _problems(record, PASS_FIELDS, ("kind",))
    if out:
        return out
    fields, required = PASS_KIND_FIELDS[record["kind"]]
    return _problems(record, fields, required)


def parse_line(line: str):
    """One line of a JSON Lines record file as JSON.

    Raises:
        ValueError: `not valid JSON (why)`: malformed, nested past what Python's parser reaches, or a number too long
            to read (a hand-edited or damaged line; never a traceback).
    """
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError("not valid JSON (nested deeper than the reader reaches)") from None
    except ValueError as e:  # an integer past sys.get_int_max_str_digits()
        raise ValueError(f"not valid JSON ({str(e).split(';')[0]})") from None


def one_line(problems: list[str]) -> str:
    """The first problem, and how many more there are."""
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
