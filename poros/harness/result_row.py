"""A cell's results row (`record`, schema version `SCHEMA`), the row `poros report` reads: the cell's settings,
its timed passes and peaks, the gate it took part in, the poros plan's predictions beside the measured
figures, where a step's copy time went (`copy_summary`) and provenance. The suites append it to the
results file as soon as the cell ends (`poros.harness.results.ResultsWriter`)."""

from __future__ import annotations

import statistics

from poros.config import Method, TrainConfig
from poros.harness.link import copy_floor, h2d_gbps, link_figure
from poros.engine.methods.registry import gate_of
from poros.harness.cells import Cell
from poros.harness.matrix import Matrix
from poros.harness.results import show_value
from poros.harness.timing import PEAKS, Measurement, retries_per_step, usable_cores
from poros.provenance import provenance

SCHEMA = 2  # results rows: 2 adds plan_name, sweep, timed, weight_bytes_h2d_per_step and pass-level resume


def step_tokens(cfg: TrainConfig, ranks: int = 1) -> int:
    """Tokens one optimizer step trains, every rank's counted."""
    return ranks * cfg.seq_len * cfg.batch_size * cfg.grad_accum


def record(m: Matrix, cell: Cell, cfg: TrainConfig, meas: Measurement | None, parity, *, reduced: bool,
           status: str = "ok", error: str | None = None, arch: str = "", plan: dict | None = None,
           timed: bool = True, alone: Measurement | None = None) -> dict:
    """One results row (the schema `poros report` reads, version `SCHEMA`). `plan`: the poros plan's summary,
    so the row carries the predicted peak and bytes beside the measured ones; `parity`: the gate this cell
    took part in (None: none); `alone`: a data-parallel cell's one-GPU measurement in the same run (its rank 0
    by itself), which `scaling` divides by."""

    steps = m.steps
    pair = gate_of(m.methods)  # (reference, method) of this matrix's gate
    gate_applies = pair is not None and parity is not None
    per_step = [t / steps for t in meas.per_pass_s] if meas else []
    row = {
        "schema": SCHEMA,
        "matrix": m.name,
        "model": cell.model,
        "arch": arch,
        "method": cell.method.value if cell.method else "parity",
        "plan_name": cell.plan,
        "sweep": {k: show_value(v) if not isinstance(v, (int, float)) or isinstance(v, bool) else v
                  for k, v in cell.point},
        "stack": cell.stack.label(),
        "stack_name": cell.stack.name,
        "steps": steps,
        "passes": m.passes,
        "warmup_passes": m.warmup_passes,
        "warmup_pass_steps": steps if m.warmup_pass_steps is None else m.warmup_pass_steps,
        "timed": timed,
        "reduced": reduced,
        "s_per_step_median": statistics.median(per_step) if per_step else None,
        "s_per_step_std": statistics.stdev(per_step) if len(per_step) > 1 else (0.0 if per_step else None),
        "per_pass_s": meas.per_pass_s if meas else [],
        "pass_gpus": meas.pass_gpus if meas else [],  # the GPU of each pass (a run in parts may change GPUs)
        "passes_of": meas.passes_of if meas else None,  # the cell that timed them, where not this one
        # the host's busiest 1-minute load average as a timed pass ended, and the CPUs the process may use: a load
        # above them means other work shared the CPUs while these passes were timed
        "load_avg_max": max((x for x in meas.pass_load if x is not None), default=None) if meas else None,
        "cores": usable_cores(),
        "world_size": cfg.gpus,  # data-parallel ranks; tokens/s counts every rank's tokens
        "tokens_per_s": step_tokens(cfg, cfg.gpus) / statistics.median(per_step) if per_step else None,
        "shard_stream": cfg.shard_stream,
        **{k: getattr(meas, k) if meas else None for k in PEAKS},
        "peak_vram_nvml_source": meas.peak_vram_nvml_source if meas else None,
        "held_before_gb": meas.held_before_gb if meas else None,
        "alloc_retries_per_step": retries_per_step(meas, steps),
        "attention_backends": meas.attention_backends if meas else None,
        "parity": None if not gate_applies or parity is None else parity.parity,
        "gate": pair[0].value if gate_applies else None,  # the reference of the gate this row took part in
        "parity_max_abs_diff": None if not gate_applies or parity is None else parity.max_abs_diff,
        "parity_first_mismatch": None if parity is None else parity.first_mismatch,
        "parity_steps": None if cell.method is Method.UNSLOTH or parity is None else parity.steps,
        "bytes_h2d_per_step": None,
        "weight_bytes_h2d_per_step": None,
        "copy_gbps": None,
        "copy_hidden_share": None,
        "status": status,
        "error": error,
        # the settings as the matrix asked them (`vram_budget: auto` stays auto, so that --resume holds the rows to
        # the matrix); the budget the run resolved is its plan's, which a report reads (report.rows.budget_bytes)
        "config": {**cfg.as_dict(), "dataset": m.dataset, "precision": m.precision, "hardware": m.hardware},
        "plan": None if plan is None else {k: plan[k] for k in (
            "block_size", "resident_layers", "streamed_layers", "kept_layers", "head_resident", "h2d_bytes_per_step",
            "peak_vram_bytes", "process_vram_bytes", "memory", "vram_budget", "accumulation", "graph_pool_bytes",
            "shards", "gathered_bytes_per_step", "d2h_bytes_per_step", "host_inputs", "host_input_bytes", "host_bytes",
            "host_budget")},
        "predicted_peak_vram_gb": None if plan is None else plan["peak_vram_bytes"] / 1e9,  # the allocated peak
        # the process's, what the budget holds and the NVML peak measures
        "predicted_process_vram_gb": None if plan is None else plan["process_vram_bytes"] / 1e9,
        "resident_layers": None if plan is None else len(plan["resident_layers"]),
        "provenance": provenance(),
    }
    row.update(copy_summary(meas.counters if meas else []))
    gbps = h2d_gbps(cfg.device.value) if row.get("weight_bytes_h2d_per_step") else None
    row["link_h2d_gbps"] = gbps  # measured in this process (poros.harness.link)
    row["copy_floor_s"] = copy_floor(row.get("weight_bytes_h2d_per_step"), link_figure([gbps, row.get("copy_gbps")]))
    alone_steps = [t / steps for t in alone.per_pass_s] if alone else []
    if alone_steps and row["tokens_per_s"]:  # the ranks' tokens/s together over one GPU's, same run
        row["scaling"] = row["tokens_per_s"] / (step_tokens(cfg) / statistics.median(alone_steps))
        row["alone_s_per_step_median"] = statistics.median(alone_steps)
    return row


def copy_summary(step_counters: list[dict]) -> dict:
    """Where a poros step's copy time went, from the engine's per-step counters: bytes host->device per
    step (weights and, with inputs kept in host memory, the saved layer inputs brought back), the weight
    bytes alone, the copy rate, the share of copy time hidden behind compute and the wait per step.

    The copy rate (`copy_gbps`) is the weight bytes divided by the time those copies took on the copy
    stream, each from its start to its end event: the link's achieved bandwidth while it copied weights.
    The engine times only the weight copies (`copy_s`), so the saved inputs' bytes are left out of the
    rate: counted in, they would be bytes copied outside the timed window, and the rate could read above
    what the link can carry. Empty for methods without counters."""
    counters = [c for c in step_counters if c.get("bytes_h2d") is not None]
    if not counters:
        return {}
    n = len(counters)
    copied = sum(c["bytes_h2d"] for c in counters)
    weights = copied - sum(c.get("input_bytes_h2d", 0) for c in counters)
    copy_s = sum(c.get("copy_s", 0.0) for c in counters)
    wait_s = sum(c.get("copy_wait_s", 0.0) for c in counters)
    out = {
        "bytes_h2d_per_step": copied // n,
        "weight_bytes_h2d_per_step": weights // n,
        "copy_gbps": weights / copy_s / 1e9 if copy_s > 0 else None,
        "copy_hidden_share": max(0.0, 1 - wait_s / copy_s) if copy_s > 0 else None,
        "copy_wait_s_per_step": wait_s / n,
    }
    gathered = [c["bytes_gathered"] for c in counters if "bytes_gathered" in c]
    if gathered:  # shared stream: each rank's share from the host, the others' from its peers
        out["h2d_bytes_per_rank"] = out["bytes_h2d_per_step"]
        out["gathered_bytes_per_rank"] = sum(gathered) // len(gathered)
        out["gather_s_per_step"] = sum(c.get("gather_s", 0.0) for c in counters) / n
    reduced = [c["allreduce_bytes"] for c in counters if "allreduce_bytes" in c]
    if reduced:  # data-parallel: LoRA gradient bytes this rank reduces over the ranks per step
        out["allreduce_bytes_per_step"] = sum(reduced) // len(reduced)
    if "capture_errors" in counters[-1]:  # CUDA graphs: the templates' state after the last timed step (counted
        # from the trainer's start): a capture that failed leaves its layer eager, slower but exact
        out.update({k: counters[-1][k] for k in ("graphs_captured", "capture_errors", "template_fallbacks")})
    kept = [c for c in counters if "attention_replayed" in c]
    if kept:  # keep_attention: fused attention calls per step the recomputes took from the forward, or ran again
        out["attention_replayed_per_step"] = sum(c["attention_replayed"] for c in kept) / len(kept)
        out["attention_computed_per_step"] = sum(c["attention_computed"] for c in kept) / len(kept)
    return out
