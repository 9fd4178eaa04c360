"""Compare poros schedules on one model, built once: each schedule gated, then timed.

    python3 scripts/sweep.py qwen2.5-72b --resident \
        --variant cuda_graphs=true --variant cuda_graphs=true,vram_budget=24GB \
        --grad-accum 1,8 [--steps 6 --passes 2 --gate-steps 2] [--attention math] [--out DIR]
    python3 scripts/sweep.py qwen2.5-72b --reference resident_gc --resident --seq-len 32768 \
        --attention flash --deterministic --loss-chunk 4096 --variant cuda_graphs=true,offload_inputs=true
    python3 scripts/sweep.py qwen2.5-72b --resident --unsloth --variant cuda_graphs=true,vram_budget=49GB
    torchrun --nproc-per-node 2 scripts/sweep.py qwen3-32b --resident --variant cuda_graphs=true

A variant is a comma-separated list of the schedule settings of poros/settings.py (block_size, vram_budget,
placement, keep_activations, kept_layers, cuda_graphs, ...); what is computed (--seq-len, --grad-accum,
--attention, --deterministic, --loss-chunk) is the sweep's. Per value of --grad-accum, the reference (resident QLoRA, or with
`--reference resident_gc` resident QLoRA with gradient checkpointing, where plain resident does not fit)
runs the gate's steps first and its states are recorded in host memory (so a schedule is gated even when
it and the reference would not fit the device together), then each variant is gated against them and
timed alone: one warm-up pass and --passes passes of --steps steps. One JSON line per variant (and per
reference with --resident),
appended to DIR/sweep.jsonl with --out. `--unsloth` also times Unsloth on the same store (exported
as a bitsandbytes checkpoint, run in a child process; not gated: its arithmetic differs, so it runs without
strict determinism, as its users run it). `--control` runs
the reference a second time against its own recorded states: is this stack repeatable at all?
`POROS_PROFILE_SETUP=N` prints the N costliest functions of each trainer's set-up (cProfile) to stderr.
Under torchrun every method is data-parallel (poros.engine.distributed; the reference under
DistributedDataParallel), each rank gates its own states, rows record `world_size` and count the tokens
of every rank, and the peak is the largest rank's. The official figures come from `poros bench matrix`.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from poros.harness.bench import PEAKS, copy_summary, free_device_memory, measure, step_tokens
from poros.engine.distributed import SINGLE, World, agree, barrier, close_world, init_world, largest, share_store
from poros.config import Method, TrainConfig
from poros.engine.executor import PorosTrainer
from poros.engine.methods import config_for, make_trainer
from poros.engine.parity import RecordedReference, run_gate_recorded
from poros.settings import SCHEDULE_NAMES, check_values
from poros.engine.trainer import enable_determinism


def parse_variant(text: str) -> dict:
    raw = {}
    for item in filter(None, text.split(",")):
        k, eq, v = item.partition("=")
        if not eq or k not in SCHEDULE_NAMES:
            raise SystemExit(f"variant {text!r}: expected KEY=VALUE with KEY one of {', '.join(SCHEDULE_NAMES)}")
        raw[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.isdigit() else v)
    values, problems = check_values(raw)
    if problems:
        raise SystemExit(f"variant {text!r}: {'; '.join(problems)}")
    return values


def echo(variant: dict) -> dict:
    """A variant's settings as rows and the log write them (enums by their value)."""
    return {k: getattr(x, "value", x) for k, x in variant.items()}


class Stopped(BaseException):
    """SIGTERM arrived (a `timeout`, a scheduler): the sweep writes what it reached, then ends."""


def _stopped(signum, frame):
    raise Stopped(f"stopped by signal {signum}")


def timed(trainer, cfg: TrainConfig, steps: int, passes: int, world: World = SINGLE) -> dict:
    free_device_memory()
    if cfg.device.value == "cuda":
        torch.cuda.reset_peak_memory_stats()
    meas = measure(trainer, cfg, steps, passes, warmup=1, label=getattr(trainer, "method", "poros"))
    peaks = {k: largest(getattr(meas, k), world) for k in PEAKS}
    out = {**speed(meas.per_pass_s, steps, cfg, world.size),
           **{k: None if v is None else round(v, 3) for k, v in peaks.items()},
           "attention_backends": meas.attention_backends}
    out.update(copy_summary(meas.counters))
    return out


def speed(per_pass_s: list[float], steps: int, cfg: TrainConfig, ranks: int = 1) -> dict:
    """s/step (median over passes, and per pass) and tokens/s counting every rank's tokens."""
    per_step = [t / steps for t in per_pass_s]
    med = statistics.median(per_step)
    return {"s_per_step_median": round(med, 4), "per_step_by_pass": [round(t, 4) for t in per_step],
            "tokens_per_s": round(step_tokens(cfg, ranks) / med, 1)}


def constructed(make, what: str):
    """`make()`; with POROS_PROFILE_SETUP set, its profile's top functions (cumulative time) on stderr, to
    find where a set-up's seconds go."""
    if not os.environ.get("POROS_PROFILE_SETUP"):
        return make()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(make)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(int(os.environ["POROS_PROFILE_SETUP"]))
    print(f"set-up profile of {what}:\n{text.getvalue()}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--variant", action="append", default=[], help="schedule settings, e.g. cuda_graphs=true,vram_budget=24GB")
    p.add_argument("--resident", action="store_true", help="also time the reference")
    p.add_argument("--reference", default="resident", choices=("resident", "resident_gc"),
                   help="the gate's reference: resident QLoRA, or resident_gc (with gradient checkpointing: long "
                        "context, where plain resident does not fit)")
    p.add_argument("--unsloth", action="store_true", help="also time Unsloth on the same store (a child process)")
    p.add_argument("--alone", action="store_true",
                   help="under torchrun, after each poros plan's timing, rank 0 times the same trainer by itself "
                        "(its own micro-batches, no all-reduce) while the other ranks wait: the one-GPU figure "
                        "of the scaling table, from the same process and set-up")
    p.add_argument("--control", action="store_true",
                   help="also gate a second run of the reference against its recorded states (repeatability)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--gate-steps", type=int, default=2)
    p.add_argument("--attention", default="math",
                   help="comma-separated values (e.g. math,fast: both on one store build and one GPU)")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--seq-len", default="512", help="comma-separated values, one store build for them all")
    p.add_argument("--loss-chunk", type=int, help="tokens per chunk of the head (default: the model's own loss)")
    p.add_argument("--grad-accum", default="1", help="comma-separated values, each with its own reference")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.deterministic:
        enable_determinism()
    variants = [parse_variant(v) for v in args.variant]
    world = init_world(args.device)
    if world.distributed and args.unsloth:
        raise SystemExit("--unsloth times one process: run it without torchrun")
    t0 = time.perf_counter()

    def stage(what: str) -> None:  # where a long sweep is, on stderr (every rank)
        print(f"[sweep rank {world.rank}/{world.size} {time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _stopped)  # `timeout` and schedulers send it: the row in hand is written first
    if os.environ.get("POROS_STACKS_AFTER"):  # a sweep still running after this many seconds dumps every stack
        faulthandler.dump_traceback_later(float(os.environ["POROS_STACKS_AFTER"]), exit=False)
    stage(f"building {args.model}")
    store, stats = share_store(args.model, seed=0, device=args.device, world=world, progress=None)
    stage(f"store ready ({stats.seconds:.1f} s build)")
    if args.device == "cuda":  # once, for every trainer: resident's set-up then copies at pinned speed too
        store.pin()
        stage("store pinned")

    from poros.provenance import provenance

    prov = provenance()  # once: commit, versions, GPU name/UUID (which machine a figure came from)

    def emit(row: dict) -> None:
        row = {"model": args.model, "attention": current["attention"], "seq_len": current["seq_len"], "loss_chunk": args.loss_chunk,
               "world_size": world.size, "build_s": round(stats.seconds, 1), **row, "provenance": prov}
        if not world.main:
            return
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            with (args.out / "sweep.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")

    current = {}
    for attention, seq, accum in [(a, int(s), int(g)) for a in args.attention.split(",") for s in args.seq_len.split(",")
                                  for g in args.grad_accum.split(",")]:
        current.update(seq_len=seq, attention=attention)
        base = TrainConfig(model=args.model, seq_len=seq, grad_accum=accum, device=args.device,
                           attention=attention, deterministic=args.deterministic, loss_chunk=args.loss_chunk)
        stage(f"attention {attention}, seq {seq}, grad_accum {accum}: {args.reference} set up")
        try:
            resident = constructed(lambda: make_trainer(Method(args.reference), store, base, world), args.reference)
            stage(f"{args.reference}: recording {args.gate_steps} gate steps")
            reference = RecordedReference(resident, args.gate_steps)
        except Exception as e:  # e.g. out of memory at this length: a row, then the next length
            emit({"method": args.reference, "grad_accum": accum, "error": f"{type(e).__name__}: {e}"[:500]})
            resident = None  # what it holds on the device goes before the next length
            free_device_memory()
            continue
        stage(f"{args.reference}: recorded")
        if args.control:  # the same trainer from its initial weights: building it again costs more than its steps
            resident.reset_to(reference.init)
            gate = agree(run_gate_recorded(reference, resident), world)
            emit({"method": f"{args.reference} (control)", "grad_accum": accum, "parity": gate.parity,
                  "parity_steps": gate.steps, "tensors_compared": gate.tensors_compared,
                  "first_mismatch": gate.first_mismatch, "gate": "control (recorded)"})
        if args.resident:
            resident.reset_to(reference.init)
            emit({"method": args.reference, "grad_accum": accum, **timed(resident, base, args.steps, args.passes, world)})
        resident.close()
        del resident
        free_device_memory()
        for v in variants:
            cfg = base.replace(**v)
            if cfg.device.value == "cuda":
                torch.cuda.reset_peak_memory_stats()
            stage(f"poros {echo(v)}: set up")
            try:
                poros = constructed(lambda: PorosTrainer(store, cfg, world=world), f"poros {echo(v)}")
            except Exception as e:  # e.g. a budget below the smallest plan: say so and go on
                emit({"method": "poros", "grad_accum": accum, **echo(v),
                      "error": f"{type(e).__name__}: {e}"})
                continue
            plan = poros.plan.summary()
            plan_row = {"method": "poros", "grad_accum": accum, **echo(v),
                   "block_size": plan["block_size"], "resident_layers": len(plan["resident_layers"]),
                   "head_resident": plan["head_resident"], "predicted_h2d_bytes_per_step": plan["h2d_bytes_per_step"],
                   "predicted_peak_vram_gb": round(plan["peak_vram_bytes"] / 1e9, 3),
                   "predicted_graph_pool_gb": round(plan["graph_pool_bytes"] / 1e9, 3),
                   "predicted_memory_gb": {k: round(x / 1e9, 3) for k, x in plan["memory"].items()}}
            row, verdict = dict(plan_row), {}
            try:
                stage(f"poros {echo(v)}: gate")
                gate = agree(run_gate_recorded(reference, poros), world)  # then timed after a discarded warm-up pass
                verdict = {"parity": gate.parity, "parity_steps": gate.steps, "tensors_compared": gate.tensors_compared,
                           "first_mismatch": gate.first_mismatch, "gate": gate.gate}
                row.update(verdict)
                stage(f"poros {echo(v)}: {gate.parity}; timing")
                row.update(timed(poros, cfg, args.steps, args.passes, world))
            except BaseException as e:  # out of memory, or stopped (SIGTERM, Ctrl-C): what was reached is a row
                row["error"] = f"{type(e).__name__}: {e}"[:500] + (" (during timing)" if "parity" in row else "")
                emit(row)
                if not isinstance(e, Exception):
                    raise
                poros.close()
                del poros
                free_device_memory()
                continue
            row["engine_counters"] = {k: x for k, x in poros.counters().items() if k in (
                "layer_templates", "forward_templates", "template_fallbacks", "graphs_captured", "capture_errors")}
            emit(row)
            if args.alone and world.distributed:
                stage(f"poros {echo(v)}: rank 0 alone" if world.main else f"poros {echo(v)}: waiting for rank 0 alone")
                if world.main:
                    try:
                        with poros.alone():
                            solo = timed(poros, cfg, args.steps, args.passes)
                        emit({**plan_row, **verdict, **solo, "world_size": 1, "alone_of": world.size,
                              "gate": f"{verdict['gate']} (under {world.size} ranks)"})
                    except Exception as e:
                        emit({"method": "poros", "grad_accum": accum, "world_size": 1, "alone_of": world.size,
                              "error": f"{type(e).__name__}: {e}"[:500]})
                barrier(world)
            poros.close()
            del poros
            free_device_memory()
        if args.unsloth:  # last: a child process, the plans' rows already written if it is cut off
            from poros.engine.unsloth import measure_unsloth

            try:
                cfg = config_for(Method.UNSLOTH, base)  # not gated: as its users run it
                rec = measure_unsloth(store, cfg, args.steps, args.passes, warmup=1,
                                      log=lambda m: print(m, file=sys.stderr))
                emit({"method": "unsloth", "grad_accum": accum, "deterministic": cfg.deterministic,
                      **speed(rec["per_pass_s"], args.steps, cfg),
                      **{k: round(rec[k], 3) for k in PEAKS if rec.get(k) is not None},
                      "unsloth_version": rec.get("unsloth_version")})
            except Exception as e:  # a failed Unsloth run is a row, not the end of the sweep
                emit({"method": "unsloth", "grad_accum": accum, "error": f"{type(e).__name__}: {e}"})
            free_device_memory()
    close_world()


if __name__ == "__main__":
    main()
