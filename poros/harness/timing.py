"""Timed passes: the one timed-pass loop every method runs (`timed_rounds`, through pytest-benchmark's fixture
where it records), and `measure`, which times a trainer's passes after its warm-up, continues after the
passes an earlier run timed, stops between passes at the run's time budget (`OutOfTime`), and keeps each
pass's seconds, counters and allocator retries and the device's peaks (torch's and NVML's) in a
`Measurement`; what it prints goes through `poros.harness.console`."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch

from poros.config import TrainConfig
from poros.engine.runtime.nvml import NvmlPeak, alloc_retries
from poros.harness.budget import OutOfTime, TimeBudget  # noqa: F401 (OutOfTime: raised from here, caught by callers)
from poros.harness.pytest_benchmark_adapter import add_earlier_rounds, last_round
from poros.harness.console import add_phase_time, progress, status, stop_if_interrupted
from poros.provenance import this_gpu_uuid


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


PEAKS = ("peak_vram_gb", "peak_reserved_gb", "peak_vram_nvml_gb")  # the device peaks a Measurement records


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
    # per timed pass, the UUID of the GPU it ran on (None where unknown: the CPU, a pass of an engine that did
    # not record it): a run in parts may time one cell's passes on several GPUs
    pass_gpus: list[str | None] = field(default_factory=list)
    # the cell whose passes these are, where a cell ran as an earlier one did (a swept setting its method does
    # not take) and took its passes
    passes_of: str | None = None
    # per timed pass, the host's 1-minute load average as it ended (None where not known): above the cores the
    # process may use, other work shared them and the pass's time says less about poros than about the machine
    pass_load: list[float | None] = field(default_factory=list)
    # device memory this process's allocator held as the cell's trainer was made (what earlier cells left
    # allocated, None off CUDA): the peaks above include it, a plan's prediction does not
    held_before_gb: float | None = None


def host_load() -> float | None:
    """The host's 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the platform says, else every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
            add_earlier_rounds(benchmark, earlier)

    def teardown():
        i = count[0]
        count[0] += 1
        if done is not None:
            done(i, None if i < warmup else last_round(benchmark))

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
            budget: TimeBudget | None = None, benchmark=None, on_warmup=None,
            stop_after: int | None = None) -> Measurement:
    """Time `passes` passes of `steps` optimizer steps after `warmup` discarded passes (of `warmup_steps`
    steps each, default `steps`), each pass one round of `timed_rounds` (pytest-benchmark's where `benchmark`
    is given).

    `earlier`: passes a killed or budgeted run already timed ({"seconds", "counters", peaks}); only the
    rest are run (after the warm-up, which every process runs). `on_pass(record)` gets each timed pass as
    soon as it ends, `on_warmup(seconds)` each warm-up pass. `budget`: a pass that would end past it is not started
    (`OutOfTime`), judged by the last timed pass (an earlier run's, before this process has timed one) or
    the pace of the warm-up's second half (its first steps compile); the warm-up itself is not started when it
    and one pass would not fit, judged by an earlier run's pass; and a pass or warm-up that its own steps show
    cannot end within it is stopped (`TimeBudget.watch`). `stop_after`: this process times at most this many
    passes, the rest left to a later one (`--passes-per-part`).

    Raises:
        OutOfTime: the budget ran out between passes.
    """
    device = cfg.device.value
    out = Measurement()
    for rec in earlier:
        out.per_pass_s.append(rec["seconds"])
        out.counters.extend(rec.get("counters") or [])
        out.alloc_retries.append(rec.get("alloc_retries"))
        out.pass_gpus.append(rec.get("gpu"))
        out.pass_load.append(rec.get("load_avg"))
    gpu = this_gpu_uuid() if device == "cuda" else None
    todo = passes - len(out.per_pass_s)
    if stop_after is not None:
        todo = min(todo, stop_after)
    wsteps = steps if warmup_steps is None else warmup_steps
    pace = {"s_per_step": earlier[-1]["seconds"] / steps if earlier else None}
    peaks = [{k: rec.get(k) for k in PEAKS} for rec in earlier]
    if todo > 0 and budget is not None and pace["s_per_step"] is not None:
        budget.check(f"{label} warm-up and the next pass".strip(), pace["s_per_step"] * (warmup * wsteps + steps))
    kinds = [("warm-up" if warmup == 1 else f"warm-up {w + 1}/{warmup}", wsteps) for w in range(warmup)]
    kinds += [(f"pass {i + 1}/{passes}", steps) for i in range(len(earlier), len(earlier) + todo)]
    last: dict = {}

    def run(i: int) -> None:
        kind, n = kinds[i]
        if budget is not None:
            budget.check(f"{label} {kind}".strip(), None if pace["s_per_step"] is None else pace["s_per_step"] * n)
        retried = alloc_retries(device)
        t0 = time.perf_counter()
        results, ends = [], []
        timed = i >= warmup
        with budget.watch(f"{label} {kind}".strip(), n) if budget is not None else contextlib.nullcontext():
            steps_of(n, kind, timed, results, ends)
        # a warm-up's pace is its second half's: its first steps compile and capture
        half = n - n // 2
        pace["s_per_step"] = (ends[-1] - t0) / n if timed or len(ends) < 2 else (ends[-1] - ends[0]) / half
        last.update(results=results, retried=None if retried is None else alloc_retries(device) - retried, t0=t0)

    def steps_of(n: int, kind: str, timed: bool, results: list, ends: list) -> None:
        """The `n` steps of a round (`kind`): their results, and the times their ends were synchronized at."""
        for s in range(n):
            stop_if_interrupted()
            r = trainer.step()
            results.append(r)  # its loss and copy timings read after the pass: no synchronization a step
            status(f"{kind}, step {s + 1}/{n}")
            last = s + 1 == n
            if last or (not timed and s + 1 == n // 2):
                _sync(device)
                ends.append(time.perf_counter())
            if ((s + 1) % max(1, n // 4) == 0 or last) and (last or s > 0):
                # within the pass the line shows the step before this one: reading a loss waits for its
                # step's kernels, and the step just enqueued keeps the device busy meanwhile, where waiting
                # for this step's would leave it idle until the host enqueued the next
                shown = s + 1 if last else s
                progress(f"  {label} {kind}: step {shown}/{n} loss {results[shown - 1].loss:.4f}")

    def done(i: int, seconds: float | None) -> None:
        if seconds is None:
            if on_warmup is not None:
                on_warmup(time.perf_counter() - last["t0"])
            return
        counters = [r.counters for r in last["results"]]  # outside the round's time
        out.per_pass_s.append(seconds)
        out.counters.extend(counters)
        out.alloc_retries.append(last["retried"])
        out.pass_gpus.append(gpu)
        out.pass_load.append(host_load())
        peaks.append(_peaks(device, nvml))
        progress(f"  time: {kinds[i][0]} {seconds:.1f} s")
        if on_pass is not None:
            on_pass({"index": len(out.per_pass_s) - 1, "seconds": seconds, "load_avg": out.pass_load[-1],
                     "counters": counters,
                     "alloc_retries": last["retried"], "gpu": gpu, **peaks[-1]})

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
