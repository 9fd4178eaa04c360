"""Rows of a sweep's results files: loading them and reading their fields the same way for tables and plots."""

from __future__ import annotations

import json
from pathlib import Path

from poros.errors import PorosError

REFERENCES = ("resident", "resident_gc")  # the gate's reference; plain resident preferred as the baseline
DEFAULTS = {"grad_accum": 1, "world_size": 1}  # rows written before these keys existed


def load_sweeps(paths) -> list[dict]:
    """Rows of sweep files, in order; a row that failed to plan keeps its error."""
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise PorosError(f"{path}: no such sweep file")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise PorosError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not rows:
        raise PorosError("no sweep rows in " + ", ".join(map(str, paths)))
    return rows


def field(r: dict, name: str):
    """A row's value of `name`, with the default of rows that predate the key."""
    return r.get(name, DEFAULTS.get(name))


def is_control(r: dict) -> bool:
    return r["method"].endswith("(control)")


def is_timed(r: dict) -> bool:
    """A row with a timing: not a failed run, not a control (parity only)."""
    return "error" not in r and not is_control(r) and r.get("s_per_step_median") is not None


def computed(r: dict) -> tuple:
    """What a row computes: rows agreeing on it did the same work, so their timings compare."""
    return r["model"], r.get("seq_len"), field(r, "grad_accum"), r.get("attention"), r.get("loss_chunk")


def _gpus(r: dict) -> list[dict]:
    return r["provenance"].get("gpus") or []


def gpu_uuid(r: dict) -> str:
    """The first GPU of the row's machine (a data-parallel run's NVML list starts with it), or cpu."""
    gpus = _gpus(r)
    return gpus[0]["uuid"] if gpus else "cpu"


def run_of(r: dict) -> tuple:
    """The sweep a row came from (its host and start time): timings compare within one run only."""
    return r["provenance"].get("host"), r["provenance"].get("time")


def gpu_label(r: dict) -> str:
    """A short name for the row's (first) GPU: the first 8 hex digits of its UUID, or cpu."""
    uuid = gpu_uuid(r)
    return uuid.removeprefix("GPU-")[:8] if uuid != "cpu" else uuid


def same_machine(one: dict, many: dict) -> bool:
    """Whether a one-GPU row ran on a GPU of the machine of a data-parallel row (same host, and the
    one-GPU row's GPU among the other's)."""
    if one["provenance"].get("host") != many["provenance"].get("host"):
        return False
    if not _gpus(one) or not _gpus(many):
        return not _gpus(one) and not _gpus(many)
    return gpu_uuid(one) in {g["uuid"] for g in _gpus(many)}


def plan_name(r: dict) -> str:
    if r["method"] != "poros":
        return r["method"]
    budget = r.get("vram_budget")  # bytes; a string in a failed row's echo of its variant, or `auto`
    if budget in (None, "None"):
        parts = ["every layer streamed"]
    elif isinstance(budget, (int, float)) or str(budget).isdigit():
        parts = [f"budget {float(budget) / 1e9:g} GB"]
    else:
        parts = [f"budget {budget}"]
    if r.get("placement") == "spread":
        parts.append("spread")
    if r.get("offload_inputs") in (True, "True"):
        parts.append("inputs in host memory")
    if r.get("overlap_backward") in (False, "False"):
        parts.append("serial backward")
    if r.get("accumulation") not in (None, "layer"):
        parts.append(f"{r['accumulation']}-major accumulation")
    if r.get("keep_activations") in (True, "True"):
        kept = r.get("kept_layers")
        parts.append("activations kept" + ("" if kept in (None, "None") else f" ({kept} layers)"))
    if r.get("cuda_graphs") in (True, "True"):
        parts.append("CUDA graphs")
    return "poros, " + ", ".join(parts)
