"""One-off: rewrite the sweep rows the report pages read into results rows of schema 2, in place, and check
that every converted row holds the old row's figures exactly."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from poros.config import Method, TrainConfig
from poros.engine.methods import config_for
from poros.models.shapes import SHAPES
from poros.settings import SCHEDULE_NAMES, check_values

# file -> (matrix that re-measures it, the computed settings its matrix sweeps)
FILES = {
    "results/h200-planner/sweep_qwen3-32b.jsonl": ("h200-plans", ("grad_accum",)),
    "results/h200-planner/sweep_qwen3-32b_accum8.jsonl": ("h200-plans", ("grad_accum",)),
    "results/h200-planner/sweep_qwen2.5-72b_budgets.jsonl": ("h200-plans", ("grad_accum",)),
    "results/h200-planner/sweep_qwen2.5-72b_accum8.jsonl": ("h200-plans", ("grad_accum",)),
    "results/h200-planner/sweep_peaks_qwen2.5-32b_gemma3-27b_gemma4-31b.jsonl": ("h200-plans", ("grad_accum",)),
    "results/h200-flash-deterministic/sweep_controls.jsonl": ("h200-flash", ("seq_len", "grad_accum")),
    "results/h200-flash-deterministic/sweep_qwen2.5-72b_seq16384.jsonl": ("h200-flash", ("seq_len", "grad_accum")),
    "results/h200-flash-deterministic/sweep_qwen2.5-72b_accum8.jsonl": ("h200-flash", ("seq_len", "grad_accum")),
    "results/h200x2-data-parallel/sweep_one_gpu.jsonl": ("h200-flash", ("seq_len", "grad_accum")),
    "results/h200x2-fast-attention/sweep_qwen2.5-72b_budgets.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-fast-attention/sweep_qwen2.5-72b_accum8.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-fast-attention/sweep_qwen2.5-72b_long.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-fast-attention/sweep_qwen2.5-32b.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-fast-attention/sweep_qwen3-32b_gemma3-27b_gemma4-31b.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-spread-long-context/sweep_qwen2.5-72b_accum32.jsonl": ("h200-fast", ("seq_len", "grad_accum")),
    "results/h200x2-spread-long-context/sweep_qwen2.5-72b_placement.jsonl": ("h200-spread", ()),
    "results/h200x2-spread-long-context/sweep_math_fast.jsonl": ("h200-attention", ("attention",)),
    "results/h200x2-spread-long-context/sweep_qwen2.5-72b_long.jsonl": ("h200-long", ("seq_len",)),
    "results/h200x2-spread-long-context/sweep_qwen3-32b_long.jsonl": ("h200-long", ("seq_len",)),
    "results/h200-kept-activations/sweep_qwen2.5-72b_long_unsloth.jsonl": ("h200-long", ("seq_len",)),
    "results/h200x2-fast-attention/sweep_data_parallel.jsonl": ("h200-data-parallel", ("gpus",)),
    "results/h200-kept-activations/sweep_qwen2.5-72b_budget_kept.jsonl": ("h200-budget", ()),
    "results/h200-kept-activations/sweep_qwen2.5-72b_floor.jsonl": ("h200-budget", ()),
    "results/h200-kept-activations/sweep_qwen2.5-72b_kept_under_load.jsonl": ("h200-budget", ()),
}
PEAKS = ("peak_vram_gb", "peak_reserved_gb", "peak_vram_nvml_gb")
KEPT = ("per_step_by_pass", "build_s", "tensors_compared", "engine_counters", "unsloth_version", "alone_of", "copy_wait_s_per_step",
        "predicted_h2d_bytes_per_step", "predicted_memory_gb")


def argv_value(argv: list[str], flag: str, default):
    return type(default)(argv[argv.index(flag) + 1]) if flag in argv else default


def echoed(v):
    """A setting as a failed row echoed its variant (text) or a written row recorded it."""
    return {"True": True, "False": False, "None": None}.get(v, int(v) if str(v).isdigit() else v) \
        if isinstance(v, str) else v


def plan_name(schedule: dict) -> str:
    budget = schedule.get("vram_budget")
    parts = ["streamed" if budget is None else f"{budget / 1e9:g}GB"]
    if schedule.get("placement") == "spread":
        parts.append("spread")
    if schedule.get("offload_inputs"):
        parts.append("offload")
    if schedule.get("overlap_backward") is False:
        parts.append("serial")
    if schedule.get("keep_activations"):
        parts.append("kept" + ("" if schedule.get("kept_layers") is None else str(schedule["kept_layers"])))
    if not schedule.get("cuda_graphs"):
        parts.append("eager")
    return "+".join(parts)


def convert(old: dict, matrix: str, axes: tuple[str, ...]) -> dict:
    prov = old["provenance"]
    argv = prov.get("argv") or []
    steps, method = argv_value(argv, "--steps", 6), old["method"]
    control, previous = method.endswith(" (control)"), method == "poros (previous engine)"
    base = method.removesuffix(" (control)")
    base = "poros" if previous else base
    world = old.get("world_size", 1)
    cfg = TrainConfig(model=old["model"], seq_len=old["seq_len"], grad_accum=old.get("grad_accum", 1),
                      attention=old["attention"], deterministic="--deterministic" in argv,
                      loss_chunk=old.get("loss_chunk"), device="cuda", gpus=world)
    schedule = {}
    if base == "poros":
        raw = {k: echoed(old[k]) for k in SCHEDULE_NAMES if k in old and k != "block_size"}
        schedule, problems = check_values(raw)
        assert not problems, problems
        cfg = cfg.replace(**schedule)
    elif base == "unsloth":
        cfg = config_for(Method.UNSLOTH, cfg)
        assert cfg.deterministic == old["deterministic"], old
    error = old.get("error")
    per_step = old.get("per_step_by_pass") or []
    timed = error is None and not control and old.get("s_per_step_median") is not None
    parity = old.get("parity")
    gate = old.get("gate")
    row = {
        "schema": 2, "matrix": matrix, "run": prov["time"], "model": old["model"], "arch": SHAPES[old["model"]].arch,
        "method": base, "plan_name": ("previous_engine" if previous else plan_name(schedule)) if base == "poros" else None,
        "control": control,
        "sweep": {k: getattr(cfg, k) if k != "attention" else cfg.attention.value for k in axes},
        "stack": f"torch {prov['torch']} / transformers {prov['versions']['transformers']}", "stack_name": "current",
        "steps": steps, "passes": len(per_step) or argv_value(argv, "--passes", 2), "warmup_passes": 1,
        "warmup_steps": steps, "timed": timed, "reduced": False,
        "s_per_step_median": old.get("s_per_step_median"),
        "s_per_step_std": (statistics.stdev(per_step) if len(per_step) > 1 else 0.0) if per_step else None,
        "per_pass_s": [x * steps for x in per_step], "world_size": world, "tokens_per_s": old.get("tokens_per_s"),
        **{k: old.get(k) for k in PEAKS}, "attention_backends": old.get("attention_backends"),
        "parity": parity, "gate": None if gate is None else gate.split(" ")[0] if not control else base,
        "parity_max_abs_diff": None, "parity_first_mismatch": old.get("first_mismatch"),
        "parity_steps": old.get("parity_steps"),
        "bytes_h2d_per_step": old.get("bytes_h2d_per_step"), "copy_gbps": old.get("copy_gbps"),
        "copy_hidden_share": old.get("copy_hidden_share"),
        # not measured: a plan below the smallest one, or a cell stopped (SIGTERM) while it was timed
        "status": "ok" if error is None else "skipped", "error": error,
        "config": {**cfg.as_dict(), "dataset": "synthetic", "precision": "nf4", "hardware": prov["gpus"][0]["name"]},
        "plan": None if "block_size" not in old else {"block_size": old["block_size"],
                                                      "head_resident": old["head_resident"],
                                                      "h2d_bytes_per_step": old["predicted_h2d_bytes_per_step"]},
        "predicted_peak_vram_gb": old.get("predicted_peak_vram_gb"), "resident_layers": old.get("resident_layers"),
        **{k: old[k] for k in KEPT if k in old},
        "provenance": prov,
    }
    check(old, row)
    return row


def check(old: dict, new: dict) -> None:
    """The converted row holds every figure of the old one exactly."""
    same = [("s_per_step_median", "s_per_step_median"), ("tokens_per_s", "tokens_per_s"), ("parity", "parity"),
            ("parity_steps", "parity_steps"), ("first_mismatch", "parity_first_mismatch"),
            ("bytes_h2d_per_step", "bytes_h2d_per_step"), ("copy_gbps", "copy_gbps"),
            ("copy_hidden_share", "copy_hidden_share"), ("predicted_peak_vram_gb", "predicted_peak_vram_gb"),
            ("resident_layers", "resident_layers"), ("error", "error"), ("provenance", "provenance"),
            ("attention_backends", "attention_backends"), *((k, k) for k in PEAKS), *((k, k) for k in KEPT)]
    for o, n in same:
        assert old.get(o) == new.get(n), (o, old.get(o), new.get(n))
    if "block_size" in old:
        assert (new["plan"]["block_size"], new["plan"]["head_resident"], new["plan"]["h2d_bytes_per_step"]) == \
            (old["block_size"], old["head_resident"], old["predicted_h2d_bytes_per_step"])
    steps = new["steps"]
    assert all(abs(p / steps - x) < 1e-12 for p, x in zip(new["per_pass_s"], old.get("per_step_by_pass", [])))
    for k in ("model", "seq_len", "grad_accum", "attention", "loss_chunk", "world_size"):
        want = old.get(k, {"grad_accum": 1, "world_size": 1}.get(k))
        got = new.get(k, new["config"].get(k))
        assert got == want or (k == "world_size" and new["config"]["gpus"] == want), (k, want, got)
    for k in SCHEDULE_NAMES:
        if k in old and k != "block_size" and new["method"] == "poros":
            value, _ = check_values({k: echoed(old[k])})
            assert new["config"][k] == getattr(value[k], "value", value[k]), (k, old[k], new["config"][k])
    assert new["method"] in old["method"]


def main() -> None:
    total = 0
    for path, (matrix, axes) in FILES.items():
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
        if all(r.get("schema") == 2 for r in lines):
            continue
        rows = [convert(r, matrix, axes) for r in lines]
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        total += len(rows)
        print(f"{path}: {len(rows)} rows", file=sys.stderr)
    print(f"converted {total} rows; every figure checked", file=sys.stderr)


if __name__ == "__main__":
    main()
