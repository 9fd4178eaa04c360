"""Matrix cells: parity first, then timed passes per method, each appended to results at once
(`poros.harness.results`); what they print goes through `poros.harness.console`."""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from dataclasses import dataclass, field

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods import gate_of, gated
from poros.engine.link import copy_floor, h2d_gbps
from poros.engine.nvml import NvmlPeak, alloc_retries
from poros.harness.console import add_phase_time, phase, progress, status, stop_if_interrupted
from poros.harness.matrix import Matrix, Stack
from poros.harness.results import ResultsWriter  # noqa: F401  (re-exported: the suites and tests import it here)
from poros.harness.results import point_id, row_key, show_value  # noqa: F401  (row_key: re-exported)
from poros.models.shapes import SHAPES
from poros.provenance import provenance
from poros.settings import COMPUTED_NAMES
from poros.store.build import build_store

SCHEMA = 2  # results rows: 2 adds plan_name, sweep, timed, weight_bytes_h2d_per_step and pass-level resume


@dataclass(frozen=True)
class Cell:
    model: str
    stack: Stack
    method: Method | None  # None: the parity gate of this model × stack × sweep point
    point: tuple[tuple[str, object], ...] = ()  # the swept values of this cell
    plan: str | None = None  # poros's plan by name (None: the matrix's own schedule)

    @property
    def key(self) -> tuple:
        """What identifies the cell's row: `row_key` of the row it writes."""
        return (self.model, self.stack.name, self.method.value if self.method else "parity", self.plan,
                point_id(self.point))

    @property
    def gate_key(self) -> tuple:
        """The gate this cell belongs to: one reference per model, stack and sweep point."""
        return (self.model, self.stack.name, point_id(self.point))

    @property
    def id(self) -> str:
        """Reads like a report row and selects with -k: `model:qwen3-32b-stack:current-seq_len:512-method:poros-plan:24GB`."""
        parts = [f"model:{self.model}", f"stack:{self.stack.name}"]
        if self.point:
            parts.append(point_id(self.point))
        parts.append(f"method:{self.method.value}" if self.method else "gate:parity")
        if self.plan is not None:
            parts.append(f"plan:{self.plan}")
        return "-".join(parts)


def matrix_cells(m: Matrix) -> list[Cell]:
    """Model by model, point by point: the parity gate, then each method (poros once per plan), so one
    store build serves them all."""
    cells = []
    for model in m.models:
        for stack in m.stacks:
            for point in m.points():
                pt = tuple(point.items())
                if gated(m.methods):
                    cells.append(Cell(model, stack, None, pt))
                for meth in m.methods:
                    plans = m.plan_names() if meth is Method.POROS else [None]
                    cells.extend(Cell(model, stack, meth, pt, plan) for plan in plans)
    return cells


def matrix_device(m: Matrix) -> str:
    if m.device is not None:
        return m.device.value
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_config(m: Matrix, model: str, point=None, method: Method | None = None, plan: str | None = None) -> TrainConfig:
    """The settings a cell runs with (`Matrix.settings_for`)."""
    point = dict(point or ())
    return TrainConfig.from_settings(m.settings_for(model, point, method, plan), model=model, device=matrix_device(m))


def cell_config(m: Matrix, cell: Cell) -> TrainConfig:
    return train_config(m, cell.model, cell.point, cell.method, cell.plan)


def gate_config(m: Matrix, cell: Cell, plan: str | None = None) -> TrainConfig:
    """What a gate runs both sides with: the gated method's settings (and its plan)."""
    pair = gate_of(m.methods)
    return train_config(m, cell.model, cell.point, pair[1] if pair else None, plan)


def computed_of(cfg: TrainConfig) -> dict:
    """The computed settings of a config: runs that agree on them compute the same bits."""
    d = cfg.as_dict()
    return {k: d[k] for k in COMPUTED_NAMES if k in d}


CPU_PARAM_LIMIT = 2e9  # beyond this a CPU cell would run for hours: real shapes need a GPU


def model_unavailable(model: str, device: str) -> str | None:
    """Declared gate: full-size shapes are not run on a CPU (tiny ones and checkpoints are)."""

    shape = SHAPES.get(model)
    if device == "cpu" and shape is not None and (shape.published_params or 0) > CPU_PARAM_LIMIT:
        return f"{model} has {shape.published_params / 1e9:.1f}B parameters: run it on a GPU (device: cuda)"
    return None


class StoreCache:
    """Keeps the most recently built NF4 store (host memory) so a model is built once (per `double_quant`)."""

    def __init__(self, device: str):
        self.device, self.key, self.store, self.stats = device, None, None, None

    def get(self, model: str, double_quant: bool = False):
        if self.key != (model, double_quant):

            self.store = self.stats = None
            gc.collect()
            with phase("store build"):
                self.store, self.stats = build_store(model, device=self.device, progress=None, double_quant=double_quant)
            self.key = (model, double_quant)
        return self.store


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def kept_failure(error: BaseException) -> BaseException:
    """`error`, to be kept after its handler ends (a gate's outcome, raised again for every cell that needs
    it), with the locals of every frame of its tracebacks cleared, its causes' and contexts' too: those
    frames hold the trainer that failed, and with it every tensor it had on the device, for as long as the
    error is kept."""
    seen = set()
    e = error
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__cause__, e.__context__]
    return error


PEAKS = ("peak_vram_gb", "peak_reserved_gb", "peak_vram_nvml_gb")  # the device peaks a Measurement records


def step_tokens(cfg: TrainConfig, ranks: int = 1) -> int:
    """Tokens one optimizer step trains, every rank's counted."""
    return ranks * cfg.seq_len * cfg.batch_size * cfg.grad_accum


@dataclass
class Measurement:
    per_pass_s: list[float] = field(default_factory=list)
    counters: list[dict] = field(default_factory=list)
    peak_vram_gb: float | None = None
    peak_vram_nvml_gb: float | None = None
    attention_backends: dict | None = None  # attention shape -> the SDPA backend it ran on
    # torch's reserved peak: CUDA graphs' private pools hold their intermediates as reserved, not allocated
    peak_reserved_gb: float | None = None
    # what the NVML peak measured: "process" (this process's memory, what a budget holds) or "device" (every
    # process's, where NVML does not list this one)
    peak_vram_nvml_source: str | None = None
    # per timed pass, the times torch's allocator found no free block within its cap (or the device), released
    # its cache and tried again: each release waits for the device, so retries in a step stall its overlap
    alloc_retries: list[int | None] = field(default_factory=list)


class OutOfTime(Exception):
    """The next pass would end past the run's time budget (`--max-minutes`): the cell stops between passes,
    its finished passes kept, and `--resume` continues it."""


def _peaks(device: str, nvml) -> dict:
    """The device peaks so far (torch's allocated and reserved, and NVML's)."""
    out = dict.fromkeys(PEAKS)
    if nvml is not None and nvml.peak is not None:
        out["peak_vram_nvml_gb"] = nvml.peak / 1e9
    if device == "cuda":
        out["peak_vram_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    return out


def retries_per_step(meas: Measurement | None, steps: int) -> float | None:
    """The allocator's retries per timed step (None where a pass did not count them)."""
    counts = meas.alloc_retries if meas else []
    if not counts or len(counts) != len(meas.per_pass_s) or any(c is None for c in counts):
        return None
    return sum(counts) / (len(counts) * steps)


def timed_rounds(benchmark, run, warmup: int, rounds: int, *, earlier: list[float] = (), done=None,
                 before=None) -> None:
    """The one timed-pass loop of every method: `warmup` discarded rounds, then `rounds` timed rounds; `run(i)`
    runs round `i` (warm-ups first), `before()` precedes each round outside its time (a device sync), and
    `done(i, seconds)` follows it (seconds None for a warm-up).

    Where `benchmark` (pytest-benchmark's fixture) records, each round is one of its rounds, timed by it
    (`benchmark.pedantic`, its warm-up rounds discarded), and `earlier` (the seconds of passes an earlier
    process timed the same way) come first in its statistics, so its table, JSON, comparisons and histogram
    read the passes the rows hold. Elsewhere (no fixture, --benchmark-disable, a rank) perf_counter times them.
    An exception from `run` (OutOfTime, KeyboardInterrupt) ends the loop; pytest-benchmark then keeps no
    statistics of the cell, while `done` has seen every round that ended."""
    count = [0]

    def setup():
        if before is not None:
            before()
        if count[0] == warmup:  # the first timed round: the earlier passes come first
            for t in earlier:
                benchmark.stats.stats.update(t)

    def teardown():
        i = count[0]
        count[0] += 1
        if done is not None:
            done(i, None if i < warmup else benchmark.stats.stats.data[-1])

    if benchmark is not None and not getattr(benchmark, "disabled", True) and rounds > 0:
        benchmark.pedantic(lambda: run(count[0]), setup=setup, teardown=teardown, rounds=rounds,
                           warmup_rounds=warmup, iterations=1)
        return
    for i in range(warmup + rounds if rounds > 0 else 0):
        if before is not None:
            before()
        t0 = time.perf_counter()
        run(i)
        seconds = time.perf_counter() - t0
        if done is not None:
            done(i, None if i < warmup else seconds)


def measure(trainer, cfg: TrainConfig, steps: int, passes: int, warmup: int, label: str = "", *,
            warmup_steps: int | None = None, earlier: list[dict] = (), on_pass=None,
            deadline: float | None = None, benchmark=None, on_warmup=None) -> Measurement:
    """Time `passes` passes of `steps` optimizer steps after `warmup` discarded passes (of `warmup_steps`
    steps each, default `steps`), each pass one round of `timed_rounds` (pytest-benchmark's where `benchmark`
    is given).

    `earlier`: passes a killed or budgeted run already timed ({"seconds", "counters", peaks}); only the
    rest are run (after the warm-up, which every process runs). `on_pass(record)` gets each timed pass as
    soon as it ends, `on_warmup(seconds)` each warm-up pass. `deadline` (time.monotonic()): a pass that would end past it is not started
    (`OutOfTime`), judged by the last timed pass (an earlier run's, before this process has timed one) or
    the pace of the warm-up's second half (its first steps compile); and the warm-up itself is not
    started when it and one pass would not fit, judged by an earlier run's pass.

    Raises:
        OutOfTime: the budget ran out between passes.
    """
    device = cfg.device.value
    out = Measurement()
    for rec in earlier:
        out.per_pass_s.append(rec["seconds"])
        out.counters.extend(rec.get("counters") or [])
        out.alloc_retries.append(rec.get("alloc_retries"))
    todo = passes - len(out.per_pass_s)
    wsteps = steps if warmup_steps is None else warmup_steps
    pace = {"s_per_step": earlier[-1]["seconds"] / steps if earlier else None}
    peaks = [{k: rec.get(k) for k in PEAKS} for rec in earlier]
    if todo > 0 and deadline is not None and pace["s_per_step"] is not None and \
            time.monotonic() + pace["s_per_step"] * (warmup * wsteps + steps) > deadline:
        raise OutOfTime("the warm-up and the next pass would end past the time budget")
    kinds = [("warm-up" if warmup == 1 else f"warm-up {w + 1}/{warmup}", wsteps) for w in range(warmup)]
    kinds += [(f"pass {i + 1}/{passes}", steps) for i in range(len(earlier), passes)]
    last: dict = {}

    def run(i: int) -> None:
        kind, n = kinds[i]
        if deadline is not None and pace["s_per_step"] is not None and \
                time.monotonic() + pace["s_per_step"] * n > deadline:
            raise OutOfTime(f"{kind} would end past the time budget")
        retried = alloc_retries(device)
        t0 = time.perf_counter()
        counters, ends = [], []
        timed = i >= warmup
        for s in range(n):
            stop_if_interrupted()
            r = trainer.step()
            counters.append(r.counters)
            status(f"{kind}, step {s + 1}/{n}")
            if (s + 1) % max(1, n // 4) == 0 or s + 1 == n:
                progress(f"  {label} {kind}: step {s + 1}/{n} loss {r.loss:.4f}")
            if s + 1 == n or (not timed and s + 1 == n // 2):
                _sync(device)
                ends.append(time.perf_counter())
        # a warm-up's pace is its second half's: its first steps compile and capture
        half = n - n // 2
        pace["s_per_step"] = (ends[-1] - t0) / n if timed or len(ends) < 2 else (ends[-1] - ends[0]) / half
        last.update(counters=counters, retried=None if retried is None else alloc_retries(device) - retried, t0=t0)

    def done(i: int, seconds: float | None) -> None:
        if seconds is None:
            if on_warmup is not None:
                on_warmup(time.perf_counter() - last["t0"])
            return
        out.per_pass_s.append(seconds)
        out.counters.extend(last["counters"])
        out.alloc_retries.append(last["retried"])
        peaks.append(_peaks(device, nvml))
        progress(f"  time: {kinds[i][0]} {seconds:.1f} s")
        if on_pass is not None:
            on_pass({"index": len(out.per_pass_s) - 1, "seconds": seconds, "counters": last["counters"],
                     "alloc_retries": last["retried"], **peaks[-1]})

    with NvmlPeak() as nvml:
        t0 = time.perf_counter()
        try:
            timed_rounds(benchmark, run, warmup if todo > 0 else 0, todo, earlier=[r["seconds"] for r in earlier],
                         done=done, before=lambda: _sync(device))
        finally:  # what this process spent: its timed passes, and the warm-up (compiling) before them
            timed_s = sum(out.per_pass_s[len(earlier):])
            add_phase_time("timed passes", timed_s)
            add_phase_time("warm-up", time.perf_counter() - t0 - timed_s)
    for k in PEAKS:
        values = [p[k] for p in peaks if p.get(k) is not None]
        setattr(out, k, max(values) if values else None)
    if nvml.peak is not None:
        out.peak_vram_nvml_source = nvml.source
    out.attention_backends = getattr(trainer, "attention_backends", None) or None
    return out


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
        "world_size": cfg.gpus,  # data-parallel ranks; tokens/s counts every rank's tokens
        "tokens_per_s": step_tokens(cfg, cfg.gpus) / statistics.median(per_step) if per_step else None,
        "shard_stream": cfg.shard_stream,
        **{k: getattr(meas, k) if meas else None for k in PEAKS},
        "peak_vram_nvml_source": meas.peak_vram_nvml_source if meas else None,
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
        "config": {**cfg.as_dict(), "dataset": m.dataset, "precision": m.precision, "hardware": m.hardware},
        "plan": None if plan is None else {k: plan[k] for k in (
            "block_size", "resident_layers", "streamed_layers", "head_resident", "h2d_bytes_per_step",
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
    row["link_h2d_gbps"] = gbps  # measured in this process (poros.engine.link)
    row["copy_floor_s"] = copy_floor(row.get("weight_bytes_h2d_per_step"), gbps)
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
    if reduced:  # data-parallel: LoRA gradient bytes all-reduced per step by this rank
        out["allreduce_bytes_per_step"] = sum(reduced) // len(reduced)
    if "capture_errors" in counters[-1]:  # CUDA graphs: the templates' state after the last timed step (counted
        # from the trainer's start): a capture that failed leaves its layer eager, slower but exact
        out.update({k: counters[-1][k] for k in ("graphs_captured", "capture_errors", "template_fallbacks")})
    kept = [c for c in counters if "attention_replayed" in c]
    if kept:  # keep_attention: fused attention calls per step the recomputes took from the forward, or ran again
        out["attention_replayed_per_step"] = sum(c["attention_replayed"] for c in kept) / len(kept)
        out["attention_computed_per_step"] = sum(c["attention_computed"] for c in kept) / len(kept)
    return out
