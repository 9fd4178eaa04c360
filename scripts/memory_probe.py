"""The planner's device memory against the measured, part by part, on a model cut to a few layers (a probe, not a test).

    python3 scripts/memory_probe.py qwen2.5-72b --layers 4 --seq-lens 512,8192,32768,65536 \
        --attention fast --deterministic --lora-compute bf16 --loss-chunk 2048 --mlp-chunk 2048 \
        --compile both --out out/memory-probe.jsonl [--max-minutes 5]

What grows with the sequence is one layer's recompute and backward (the plan's `transient`) and the saved inputs;
the weights, LoRA and its AdamW state are sizes the plan counts exactly. A model of the real shapes cut to
`--layers` decoder layers therefore measures the transient of the full model's plan in seconds a step: for each
sequence length (and each way of running the layers `--compile` lists) it builds poros's trainer on
the settings given (every layer streamed unless `--variant` says otherwise), runs one step (compilation, the
AdamW state), then measures the next: torch's allocated and reserved peaks and NVML's peak for the process. The
allocator runs as a budgeted run sets it (expandable segments; `--no-expandable-segments`: torch's default), without
the cap, which would change the plan of so small a model.
One JSON line per case, to stdout and `--out`:
  predicted        the plan's parts (bytes), as `poros plan` prints them, and the head's and a layer's transient
                   by the formula (`transient_bytes`; the plan's `transient` takes a compiled layer's share of it)
  measured         allocated, reserved and NVML peaks (None off CUDA)
  transient_measured  allocated peak less the plan's parts other than the transient: the transient as run
  by_operation     per kind of step operation (forward, regenerate, head, backward) its largest allocated peak, what
                   it added to the bytes allocated when it began, and its layer: the head's transient apart from a
                   layer's
  error            (predicted - measured) / measured for the allocated, reserved and NVML peaks
  provenance       the GPU, driver, torch, transformers, bitsandbytes and commit of the row
`--max-minutes` starts no case past that time; rows already written stay.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import time
from pathlib import Path

import torch

from poros.config import Method, TrainConfig
from poros.engine.runtime.allocator_limit import set_allocator_settings
from poros.engine.methods.registry import make_trainer
from poros.engine.runtime.nvml import NvmlPeak
from poros.engine.methods.executor import geometry_of_store
from poros.engine.planning.memory import transient_bytes
from poros.engine.methods.trainer import enable_determinism
from poros.models.checkpoint import cut_source
from poros.provenance import provenance
from poros.settings import schedule_variant
from poros.store.build import build_store


def parse_variant(text: str) -> dict:
    """--variant's schedule settings (poros/settings.py `schedule_variant`).

    Raises:
        SystemExit: what is wrong with it.
    """
    try:
        return schedule_variant(text)
    except ValueError as e:
        raise SystemExit(f"--variant: {e}") from None


def cut_store(model: str, layers: int, device: str):
    """The NF4 store of `model`'s shapes with its first `layers` decoder layers (poros/models/checkpoint.py
    `cut_source`).

    Raises:
        SystemExit: `layers` is out of the shape's range, with the reason.
    """
    try:
        source = cut_source(model, layers)
    except ValueError as e:
        raise SystemExit(f"--layers: {e}") from None
    return build_store(source, device=device, progress=False)[0]


# --compile's ways of running the decoder layers: (compile, compile_mlp)
COMPILE_MODES = {"yes": (True, True), "no": (False, True), "mlp-eager": (True, False)}


def listed(text: str, option: str, none: bool = False) -> list:
    """`text`, comma-separated whole numbers (and, with `none`, the word none: None).

    Raises:
        SystemExit: naming `option` and what it got.
    """
    try:
        return [None if none and v.strip() == "none" else int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{option}: expected comma-separated whole numbers{' or none' if none else ''}, "
                         f"got {text!r}") from None


def _error(predicted: float, measured: float | None) -> float | None:
    return None if not measured else round((predicted - measured) / measured, 4)


class OpPeaks:
    """While inside, each of the trainer's step operations (forward, regenerate, head, backward: poros/engine/
    interpreter.py) records the allocated peak while it ran and what it added to the bytes allocated when it began,
    the largest of each kind kept with its layer (CUDA only). A backward overlapped with the next operation
    (`overlap_backward`) is counted partly in that one."""

    KINDS = {"_forward": "forward", "_regenerate": "regenerate", "_head": "head", "_backward": "backward"}

    def __init__(self, trainer):
        self.trainer, self.peaks = trainer, {}
        # the peaks across the step, operations and what ran between them (each operation resets torch's counters)
        self.allocated = self.reserved = 0

    def _wrap(self, name: str, run):
        def measured(op):
            self._keep()  # what ran since the last operation
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                return run(op)
            finally:
                peak = torch.cuda.max_memory_allocated()
                self._keep()
                kind = self.KINDS[name]
                if peak > self.peaks.get(kind, {}).get("peak", -1):
                    self.peaks[kind] = {"peak": peak, "added": peak - start, "layer": op.layer}
        return measured

    def _keep(self) -> None:
        self.allocated = max(self.allocated, torch.cuda.max_memory_allocated())
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())

    def __enter__(self):
        for name in self.KINDS:
            setattr(self.trainer, name, self._wrap(name, getattr(self.trainer, name)))
        return self

    def __exit__(self, *exc):
        for name in self.KINDS:
            delattr(self.trainer, name)  # the class's methods again
        self._keep()  # what ran after the last operation (the optimizer's step)


def probe(store, cfg: TrainConfig) -> dict:
    """One case: the plan's parts, then one step run and the next measured."""
    cuda = cfg.device.value == "cuda"
    geo = geometry_of_store(store, cfg)
    overlap = cfg.overlap_backward and not cfg.cuda_graphs  # two layers' backwards at once (the plan's rule)
    head_t, layer_t = transient_bytes(geo, cfg.seq_len, cfg.batch_size, cfg.attention, overlap, cfg.loss_chunk,
                                      cfg.deterministic, cfg.mlp_chunk, cfg.attention_chunk)
    trainer = make_trainer(Method.POROS, store, cfg)
    try:
        m = trainer.plan.memory
        t0 = time.perf_counter()
        trainer.step()  # compiles; AdamW's state exists from here on
        first = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with NvmlPeak() as nvml, (OpPeaks(trainer) if cuda else contextlib.nullcontext()) as ops:
            result = trainer.step()
        alloc, reserved = (ops.allocated, ops.reserved) if cuda else (None, None)
        nv = nvml.peak if cuda else None
    finally:
        trainer.close()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    fixed_tensors = m.allocated - m.transient
    return {
        "predicted": {**m.parts(), "allocated": m.allocated, "reserved": m.allocator, "process": m.total,
                      "head_transient": head_t, "layer_transient": layer_t},
        "measured": {"allocated": alloc, "reserved": reserved, "process": nv},
        "transient_measured": None if alloc is None else alloc - fixed_tensors,
        "by_operation": ops.peaks if cuda else None,
        "context_measured": None if nv is None or reserved is None else nv - reserved,
        "error": {"allocated": _error(m.allocated, alloc), "reserved": _error(m.allocator, reserved),
                  "process": _error(m.total, nv)},
        "first_step_s": round(first, 2), "s_per_step": round(result.seconds, 3),
        "provenance": provenance(),  # the GPU, its driver and the software stack that measured the row
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers the model is cut to (default: 4)")
    p.add_argument("--seq-lens", default="512,8192,32768", help="comma-separated sequence lengths")
    p.add_argument("--compile", default="no",
                   help="how the decoder layers run, comma-separated to run several: yes (compiled), no (eager), "
                        "mlp-eager (compiled but for the MLP: compile_mlp off); both: yes,no (default: no)")
    p.add_argument("--attention", default="fast")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--lora-compute", default="bf16")
    p.add_argument("--loss-chunk", default="none",
                   help="tokens of the head's logits at a time, comma-separated to run several ('none': unchunked)")
    p.add_argument("--mlp-chunk", type=int)
    p.add_argument("--attention-chunk", type=int)
    p.add_argument("--block-size", type=int, default=1)
    p.add_argument("--variant", default="", help="schedule settings, KEY=VALUE,... (e.g. offload_inputs=true)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, help="start no case after this many minutes")
    p.add_argument("--expandable-segments", action=argparse.BooleanOptionalAction, default=True,
                   help="the allocator's expandable segments, as a budgeted run sets them (default: on)")
    p.add_argument("--out", type=Path, help="append each row to this JSON-lines file too")
    args = p.parse_args()
    seq_lens = listed(args.seq_lens, "--seq-lens")
    loss_chunks = listed(args.loss_chunk, "--loss-chunk", none=True)
    variant = parse_variant(args.variant)
    if args.deterministic:
        enable_determinism()
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    if args.device == "cuda" and args.expandable_segments:
        set_allocator_settings("expandable_segments:True")  # before the first device allocation
    store = cut_store(args.model, args.layers, args.device)
    if args.device == "cuda":
        store.pin()
    compiles = [COMPILE_MODES.get(m) for m in args.compile.replace("both", "yes,no").split(",")]
    if None in compiles:
        raise SystemExit(f"--compile: expected yes, no, mlp-eager or both (comma-separated), got {args.compile!r}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    for seq_len, loss_chunk, (compiled, compile_mlp) in itertools.product(seq_lens, loss_chunks, compiles):
        if deadline is not None and time.monotonic() >= deadline:
            print(json.dumps({"stopped": f"--max-minutes {args.max_minutes:g} reached"}), flush=True)
            return
        cfg = TrainConfig(model=args.model, seq_len=seq_len, block_size=args.block_size, device=args.device,
                          attention=args.attention, deterministic=args.deterministic,
                          loss_chunk=loss_chunk, mlp_chunk=args.mlp_chunk,
                          attention_chunk=args.attention_chunk, compile=compiled, compile_mlp=compile_mlp,
                          lora_compute=args.lora_compute).replace(**variant)
        row = {"model": args.model, "layers": args.layers, "seq_len": seq_len, "compile": compiled,
               "compile_mlp": compile_mlp,
               "attention": cfg.attention.value, "lora_compute": cfg.lora_compute.value,
               "loss_chunk": cfg.loss_chunk, "mlp_chunk": cfg.mlp_chunk, "attention_chunk": cfg.attention_chunk,
               "variant": {k: getattr(v, "value", v) for k, v in variant.items()},
               "expandable_segments": args.device == "cuda" and args.expandable_segments}
        try:
            row.update(probe(store, cfg))
        except Exception as e:  # a case that cannot run (out of memory, a refused plan) says why; the rest go on
            row["error_text"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
