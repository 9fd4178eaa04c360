"""Results rows in: reading and checking results files (JSON Lines) and reference figures (CSV), and the
row facts every page uses (the latest row per cell, the hardware, whether it ran on a CPU)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd

from poros.errors import PorosError
from poros.harness.record_schema import one_line, parse_line, row_problems
from poros.harness.report.format import text_or_none
from poros.provenance import is_hardware
from poros.settings import COMPUTED, SETTINGS, Setting

KEY = ("matrix", "model", "stack", "method")
REFERENCE_COLUMNS = (
    "hardware", "model", "arch", "stack", "parity", "poros_s_step_median", "poros_s_step_std", "resident_s_step",
    "unsloth_s_step", "poros_vram_gb", "resident_vram_gb", "unsloth_vram_gb",
)
REFERENCE_FIGURES = REFERENCE_COLUMNS[5:]  # seconds and GB: a page divides by them
# The official validation figures, shipped with the source tree (reports/reference/README.md).
OFFICIAL_REFERENCE = Path(__file__).resolve().parent / "official.csv"  # shipped in the package (reports/reference/ links to it)


def load_results(paths) -> pd.DataFrame:
    """Read results files (JSON Lines), in order, into one row per line.

    Raises:
        PorosError: naming the file (and line) of a missing, binary or non-UTF-8 file, malformed JSON
            or a row missing keys.
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(x) for x in paths]
    records = []
    for path in paths:
        if path.is_dir():
            raise PorosError(f"{path} is a folder, expected a results file, e.g. {path / 'results.jsonl'}")
        if not path.is_file():
            raise PorosError(f"{path}: no such results file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise PorosError(f"{path}: not a results file (byte {e.start} is not UTF-8 text; expected the JSON "
                             f"Lines a poros bench run writes, e.g. OUT/results.jsonl)") from None
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = parse_line(line)
            except ValueError as e:
                raise PorosError(f"{path}:{n}: {e}") from None
            if not isinstance(row, dict):
                raise PorosError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            bad = row_problems(row)
            if bad:
                raise PorosError(f"{path}:{n}: {one_line(bad)}; fix or remove that row (rows are written by poros bench)")
            records.append({**row, "plan_name": row.get("plan_name"),
                            "sweep": row.get("sweep") if isinstance(row.get("sweep"), dict) else {}})
    if not records:
        raise PorosError(f"no result rows in {', '.join(map(str, paths))}")
    return frame(records)


def frame(records: list[dict]) -> pd.DataFrame:
    """Rows as a DataFrame in which what a row lacks reads as its own null would: rows of an older schema
    beside newer ones lack keys the newer write, and pandas would fill those with NaN, which is truthy and
    neither a text nor a mapping. Texts missing read None (pandas' string columns hold NaN for None too)."""
    keys = dict.fromkeys(k for r in records for k in r)
    df = pd.DataFrame.from_records([{k: r.get(k) for k in keys} for r in records])
    for column in df.columns:
        if isinstance(df[column].dtype, pd.StringDtype):
            values = df[column].astype(object)
            df[column] = values.where(values.notna(), None)
    return df


def load_reference(csv_path=OFFICIAL_REFERENCE) -> pd.DataFrame:
    """Read reference figures in the format of `reports/reference/official.csv` (empty fields become NaN).

    Lines starting with `#` before the header are comments; one reading `# Source: TEXT` names where
    the figures come from, kept as `ref.attrs["source"]` and printed in the report.

    Raises:
        PorosError: naming the file when it is missing or lacks a column.
    """
    path = Path(csv_path)
    if not path.is_file():
        hint = (" (the official figures ship in a source checkout: install with pip install -e . or pass "
                "--reference FILE.csv)" if path == OFFICIAL_REFERENCE else "")
        raise PorosError(f"{path}: no such reference file{hint}")
    lines = path.read_text().splitlines(keepends=True)  # UTF-8 text: the command line checks (`reference_path`)
    comments = []
    while lines and lines[0].startswith("#"):
        comments.append(lines.pop(0)[1:].strip())
    ref = pd.read_csv(io.StringIO("".join(lines)), dtype={"hardware": str, "model": str, "stack": str, "parity": str,
                                                  "bitsandbytes": str, "dataset": str, "precision": str})
    missing = [c for c in REFERENCE_COLUMNS if c not in ref.columns]
    if missing:
        raise PorosError(f"{path}: missing column(s) {', '.join(missing)}")
    first = len(comments) + 2  # the file's line of the first figure row (after the comments and the header)
    for column in REFERENCE_FIGURES:
        values = pd.to_numeric(ref[column], errors="coerce")
        bad = [(i, v) for i, (v, n) in enumerate(zip(ref[column], values))
               if not pd.isna(v) and not (pd.notna(n) and math.isfinite(n) and n > 0)]
        if bad:
            i, v = bad[0]
            raise PorosError(f"{path}:{first + i}: column {column}: expected a positive number or nothing, got {v!r}")
        ref[column] = values
    source = [c.removeprefix("Source:").strip() for c in comments if c.startswith("Source:")]
    if source:
        ref.attrs["source"] = source[0]
    return ref


def named_as_reference(df: pd.DataFrame, ref: pd.DataFrame | None) -> pd.DataFrame:
    """The rows with each model the reference lists named as the reference writes it, its arch too
    (`Qwen3-32B`, `gemma3` for a row's `gemma3_text`); models the reference lacks keep their names."""
    if ref is None:
        return df
    names = {str(m).lower(): (str(m), a if isinstance(a, str) and a else None) for m, a in zip(ref["model"], ref["arch"])}
    found = [names.get(str(m).lower()) for m in df["model"]]
    return df.assign(model=[n[0] if n else m for n, m in zip(found, df["model"])],
                     arch=[n[1] if n and n[1] else a for n, a in zip(found, df["arch"])])


def hardware_of(row) -> str:
    """The hardware a row ran on: its matrix's declared name where the row's GPU is that hardware (or the row ran
    on none), else the name of the GPU it ran on (a matrix of one GPU run on another names the other)."""
    gpus = [] if row["config"].get("device") == "cpu" else row["provenance"].get("gpus") or []
    declared, gpu = row["config"].get("hardware"), gpus[0]["name"] if gpus else None
    if declared and (gpu is None or is_hardware(declared, gpu)):
        return declared
    return gpu or "CPU"


def on_cpu(df: pd.DataFrame) -> bool:
    """Whether every row ran on the CPU, where device memory, host→device copies and CUDA mean nothing."""
    return all((c.get("device") or ("cuda" if p.get("gpus") else "cpu")) == "cpu"
               for c, p in zip(df["config"], df["provenance"]))


def setting_shown(s: Setting, config: dict) -> str:
    """How a row's value of setting `s` reads in a report; a setting the row predates reads as its default."""
    return s.show(s.value(config[s.name])) if config.get(s.name) is not None else s.show(s.default)


def budget_bytes(row: dict) -> int | None:
    """A poros row's VRAM budget in bytes as its run resolved it: its configuration's, or, where that is `auto` (a
    row's configuration keeps the setting asked), its plan's. None: every layer streamed."""
    budget = row["config"].get("vram_budget")
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return int(budget)
    plan = row.get("plan") if isinstance(row.get("plan"), dict) else {}
    return plan.get("vram_budget") if budget is not None else None


def planned_shown(s: Setting, row: dict) -> str:
    """How a poros row's schedule setting reads: its configuration's value, or what its plan did where the planner
    turns on what the configuration left off (saved inputs in host memory, for as few layers as the budget needs)."""
    plan = row.get("plan") if isinstance(row.get("plan"), dict) else {}
    hosted = plan.get("host_inputs") or []
    if s.name == "offload_inputs" and hosted and not row["config"].get("offload_inputs"):
        layers = len(plan.get("streamed_layers") or []) + len(plan.get("resident_layers") or [])
        return f"on for {len(hosted)} of {layers} layers (planned)"
    return setting_shown(s, row["config"])


def computed_key(row) -> tuple:
    """What a row computes: its model, stack and every computed setting (poros/settings.py). Rows that agree on
    it do the same arithmetic on the same work, whatever their method's schedule."""
    return (row["model"], row["stack"], *(setting_shown(s, row["config"]) for s in SETTINGS if s.kind == COMPUTED))


def gpu_uuid(row) -> str:
    """The UUID of the GPU a row ran on (its process's first; `cpu` without one)."""
    gpus = row["provenance"].get("gpus") or []
    return gpus[0]["uuid"] if gpus else "cpu"


def row_gpus(row) -> set[str]:
    """Every GPU a row's timed passes ran on (a run in parts may time one cell's passes on several), by UUID;
    rows that do not record their passes' GPUs: the GPU of their process."""
    listed = row.get("pass_gpus")
    passes = {g for g in listed if isinstance(g, str)} if isinstance(listed, list) else set()
    return passes or {gpu_uuid(row)}


def passes_by_gpu(row) -> dict[str, list[float]] | None:
    """A row's timed passes' seconds by the GPU (UUID) each ran on; None where a pass names no GPU or the row's
    lists do not pair up (rows that predate pass GPUs)."""
    secs, gpus = row.get("per_pass_s"), row.get("pass_gpus")
    if not (isinstance(secs, list) and isinstance(gpus, list)) or not secs or len(secs) != len(gpus):
        return None
    out: dict[str, list[float]] = {}
    for s, g in zip(secs, gpus):
        if not isinstance(g, str) or not isinstance(s, (int, float)) or isinstance(s, bool) or not s > 0:
            return None
        out.setdefault(g, []).append(float(s))
    return out


def run_of(row) -> str:
    """A row's run: one matrix on one machine and GPU; rows that name their run (`run`) keep apart runs of one
    matrix."""
    return " ".join(str(x) for x in (row["matrix"], row["provenance"].get("host"), gpu_uuid(row),
                                     text_or_none(row.get("run")) or ""))


def point_label(sweep) -> str:
    return ", ".join(f"{k} {v}" for k, v in (sweep or {}).items())


def named(model: str, point: str | None, plan) -> str:
    """A model as a page's tables and plots name one of its rows: with the row's point and plan where it has them,
    e.g. `qwen2.5-72b (seq_len 65536, plan 40GB)`."""
    what = ", ".join(x for x in (point or "", text_or_none(plan) and f"plan {plan}") if x)
    return model + (f" ({what})" if what else "")


def _points(df: pd.DataFrame) -> list[str]:
    """Each row's sweep point; where the rows hold more than one sequence length (a page of several matrices, each
    at its own), the length too, so that a cell pairs only rows of one length."""
    sweeps = [dict(x or {}) for x in df["sweep"]]
    seqs = [c.get("seq_len") for c in df["config"]]
    if len(set(seqs)) > 1:
        sweeps = [{**({"seq_len": n} if "seq_len" not in x else {}), **x} for x, n in zip(sweeps, seqs)]
    return [point_label(x) for x in sweeps]


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The last row per (matrix, model, stack, method, plan, sweep point) — a re-run replaces the earlier cell."""
    df = df.copy()
    df["point"] = _points(df)
    df["plan_key"] = df["plan_name"].fillna("")
    df = df.drop_duplicates(subset=[*KEY, "plan_key", "point"], keep="last").copy()
    df["hardware"] = [hardware_of(r) for r in df.to_dict("records")]
    return df
