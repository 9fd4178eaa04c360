"""Unsloth as a third method (GPU only), measured like the others.

Unsloth patches transformers, peft and bitsandbytes globally when imported and when it loads a
model, so every Unsloth cell runs in its own child process (`python -m poros.engine.unsloth`):
the resident and poros cells of the same session keep running stock code. The child loads the
same NF4 weights, written by `poros.store.export` as a pre-quantized bitsandbytes checkpoint, through
FastLanguageModel, adds LoRA on the same projections with Unsloth's default gradient
checkpointing, and trains on the same synthetic batches with the same AdamW. `compile` does not reach it:
Unsloth compiles its own kernels and modules as its users run it (poros/engine/methods.py `config_for`).

The child reports each timed pass as it ends (a `PASS` line), so a parent that records them keeps every
finished pass; given a time budget, it starts no pass that would end past it. With `keep_export` the export
stays in the work folder for the next child on the same weights (a benchmark in parts), one store at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from poros.config import TrainConfig
from poros.engine.attention import sdpa_context
from poros.engine.data import synthetic_step
from poros.engine.nvml import NvmlPeak, alloc_retries
from poros.engine.profiling import profiled, summarize
from poros.engine.trainer import deterministic_kernels, enable_determinism
from poros.errors import CapabilityError, PorosError
from poros.store.export import export_bnb4bit

ENV = {
    "HF_HUB_OFFLINE": "1",  # no hub look-ups, statistics or model-name tables
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
RESULT = "POROS_UNSLOTH_RESULT "
PASS = "POROS_UNSLOTH_PASS "
EXPORT_PREFIX = "poros-unsloth-export-"  # kept exports (`keep_export`): one folder per store, `complete` when whole


def unavailable(device: str) -> str | None:
    """Why Unsloth cannot run here (None when it can). Declared, not discovered by trying."""
    if device != "cuda":
        return "unsloth needs a CUDA GPU (it cannot even be imported without one)"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (pip install 'poros[unsloth]')"
    return None


def store_fingerprint(store) -> str:
    """A short name for the weights a store holds: its config, its quantization and a sample of every layer's
    bytes (not all of them: tens of GB), so an export kept on disk is reused only for the same store."""
    h = hashlib.sha256(json.dumps(store.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(repr((store.source, store.double_quant, store.nbytes)).encode())
    for layer in store.layers:
        for at in (layer.start, max(layer.start, layer.end - 4096)):
            h.update(store.arena[at:at + 4096].numpy().tobytes())
    for name in sorted(store.dense):
        h.update(name.encode() + store.dense[name].flatten()[:1024].view(-1).float().numpy().tobytes())
    return h.hexdigest()[:16]


def _export(store, root: Path, keep: bool, log) -> Path:
    """The checkpoint folder the child loads: written afresh in a temporary folder, or with `keep` the kept
    export of this store (made once; another store's kept export is removed first, as they are tens of GB)."""
    if not keep:
        folder = Path(tempfile.mkdtemp(prefix="poros-unsloth-", dir=root))
        t0 = time.perf_counter()
        export_bnb4bit(store, folder)
        log(f"  unsloth: exported the NF4 checkpoint to {folder} in {time.perf_counter() - t0:.1f} s")
        return folder
    folder = root / (EXPORT_PREFIX + store_fingerprint(store))
    if (folder / "complete").is_file():
        log(f"  unsloth: the NF4 checkpoint exported earlier is in {folder}")
        return folder
    for other in root.glob(EXPORT_PREFIX + "*"):
        shutil.rmtree(other, ignore_errors=True)
    t0 = time.perf_counter()
    export_bnb4bit(store, folder)
    (folder / "complete").write_text("")
    log(f"  unsloth: exported the NF4 checkpoint to {folder} in {time.perf_counter() - t0:.1f} s (kept)")
    return folder


def remove_kept_exports(workdir: str | None = None) -> None:
    """Remove the exports `keep_export` left in the work folder."""
    root = Path(workdir or os.environ.get("POROS_WORKDIR") or tempfile.gettempdir())
    for folder in root.glob(EXPORT_PREFIX + "*"):
        shutil.rmtree(folder, ignore_errors=True)


def measure_unsloth(store, cfg, steps: int, passes: int, warmup: int, workdir: str | None = None, log=print,
                    on_record=None, profile: Path | None = None, *, warmup_steps: int | None = None,
                    on_pass=None, budget_s: float | None = None, keep_export: bool = False):
    """Export `store`, time Unsloth on it in a child process, remove the export; returns the child's record.

    `warmup` discarded passes of `warmup_steps` steps (default `steps`) come first. `on_pass(record)` gets
    each timed pass as soon as the child reports it ({"seconds", "alloc_retries", peaks}). `budget_s`: the
    child starts no pass that would end past that many seconds from its start (judged by the last pass, or
    the warm-up's pace); the record then holds fewer passes and `"stopped": "time budget"`. `keep_export`:
    the export stays for the next call on the same store (`_export`).
    `on_record(record)` runs as soon as the child has reported, before the export is removed (tens of
    GB: removing it takes seconds), so a run cut off during the clean-up keeps its result. With `profile`
    the child then profiles one more step and writes its summary there (JSON, poros/engine/profiling.py)
    and the operator table beside it (`.txt`).
    """

    why = unavailable(cfg.device.value)
    if why:
        raise CapabilityError(why)
    root = Path(workdir or os.environ.get("POROS_WORKDIR") or tempfile.gettempdir())
    folder, proc = None, None
    try:
        folder = _export(store, root, keep_export, log)
        cmd = [sys.executable, "-m", "poros.engine.unsloth", str(folder), "--steps", str(steps), "--passes", str(passes),
               "--warmup", str(warmup), "--config", json.dumps(cfg.as_dict())]
        if warmup_steps is not None:
            cmd += ["--warmup-steps", str(warmup_steps)]
        if budget_s is not None:
            cmd += ["--budget-s", f"{budget_s:.1f}"]
        if profile is not None:
            cmd += ["--profile", str(profile)]
        env = {**os.environ, **ENV, "UNSLOTH_COMPILE_LOCATION": str(root / "unsloth_compiled_cache")}
        if not cfg.deterministic:  # poros's determinism mode may have set it in this process
            env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        record, tail = None, []
        for line in proc.stdout:
            if line.startswith(RESULT):
                record = json.loads(line[len(RESULT):])
                log("  unsloth result: " + line[len(RESULT):].rstrip())
            elif line.startswith(PASS):
                if on_pass is not None:
                    on_pass(json.loads(line[len(PASS):]))
            else:
                tail = (tail + [line.rstrip()])[-30:]
                # everything the child says goes to the log as it comes: a child cut off by a time
                # budget (Unsloth may compile for minutes) still leaves where it was
                log(line.rstrip() if line.startswith("  unsloth") else "  unsloth| " + line.rstrip())
        if proc.wait() != 0 or record is None:
            raise CapabilityError(f"unsloth child failed (exit {proc.returncode}): " + " | ".join(tail[-8:]))
        if on_record is not None:
            on_record(record)
        return record
    finally:
        if proc is not None and proc.poll() is None:  # stopped or failed here: the child's GPU memory goes too
            proc.kill()
            proc.wait()
        if folder is not None and not keep_export:
            shutil.rmtree(folder, ignore_errors=True)


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m poros.engine.unsloth")
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--passes", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, help="steps of each warm-up pass (default: --steps)")
    p.add_argument("--budget-s", type=float, help="start no pass that would end past this many seconds from now")
    p.add_argument("--config", required=True, help="TrainConfig as JSON")
    p.add_argument("--profile", type=Path, help="profile one more step; its summary (JSON) here")
    args = p.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from unsloth import FastLanguageModel  # must precede transformers and peft


    cfg = TrainConfig(**json.loads(args.config))
    if cfg.deterministic:  # strict, as for every method (the parent passes CUBLAS_WORKSPACE_CONFIG on)
        enable_determinism()
    try:
        with deterministic_kernels():
            return _train(args, cfg, FastLanguageModel, sdpa_context)
    except PorosError as e:  # one line for the parent's error, not a traceback
        print(f"  unsloth: error: {e}", flush=True)
        return 3


def _train(args, cfg, FastLanguageModel, sdpa_context) -> int:
    import torch

    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    torch.cuda.reset_peak_memory_stats()
    t_load = time.perf_counter()
    with NvmlPeak() as nvml:
        model, _ = FastLanguageModel.from_pretrained(
            args.checkpoint, load_in_4bit=True, max_seq_length=cfg.seq_len, dtype=torch.bfloat16,
            local_files_only=True, use_exact_model_name=True)
        model = FastLanguageModel.get_peft_model(
            model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0, bias="none",
            target_modules=list(cfg.lora_targets), use_gradient_checkpointing="unsloth", random_state=cfg.seed)
        import bitsandbytes as bnb

        n4 = sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        if n4 == 0:
            raise SystemExit("unsloth loaded no 4-bit layers (bitsandbytes unavailable?)")
        print(f"  unsloth: loaded with LoRA in {time.perf_counter() - t_load:.1f} s ({n4} 4-bit modules)", flush=True)
        params = [q for q in model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)  # as poros.engine.trainer
        model.train()
        vocab = model.config.vocab_size
        per_pass, retries, step = [], [], 0

        def one_step(step: int) -> torch.Tensor:
            for b in synthetic_step(vocab, cfg.seq_len, cfg.batch_size, cfg.grad_accum, seed=cfg.data_seed, step=step):
                with sdpa_context(cfg.attention):
                    loss = model(input_ids=b.input_ids.cuda(), labels=b.labels.cuda()).loss / cfg.grad_accum
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        wsteps = args.steps if args.warmup_steps is None else args.warmup_steps
        pace, stopped = None, None
        for n in range(args.warmup + args.passes):
            n_steps = wsteps if n < args.warmup else args.steps
            if deadline is not None and pace is not None and time.monotonic() + pace * n_steps > deadline:
                stopped = "time budget"
                print(f"  unsloth: the next pass would end past the time budget; stopped after {len(per_pass)} "
                      f"of {args.passes} passes", flush=True)
                break
            torch.cuda.synchronize()
            retried = alloc_retries("cuda")
            t0 = t_half = time.perf_counter()
            for s in range(n_steps):
                loss = one_step(step)
                step += 1
                if n < args.warmup and s + 1 == n_steps // 2:
                    torch.cuda.synchronize()
                    t_half = time.perf_counter()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            # a warm-up's pace is its second half's: Unsloth compiles in its first steps
            pace = (time.perf_counter() - t_half) / (n_steps - n_steps // 2) if t_half > t0 else dt / n_steps
            kind = "warm-up" if n < args.warmup else f"pass {n - args.warmup + 1}/{args.passes}"
            print(f"  unsloth {kind}: {n_steps} steps in {dt:.2f} s, loss {float(loss) * cfg.grad_accum:.4f}", flush=True)
            if n >= args.warmup:
                per_pass.append(dt)
                retries.append(alloc_retries("cuda") - retried)
                print(PASS + json.dumps({
                    "seconds": dt, "alloc_retries": retries[-1],
                    "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9,
                    "peak_vram_nvml_gb": None if nvml.peak is None else nvml.peak / 1e9,
                    "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
                    "unsloth_version": _version("unsloth")}), flush=True)
        if args.profile is not None:
            write_profile(args.profile, lambda: one_step(step))
    per_step = [t / args.steps for t in per_pass]
    print(RESULT + json.dumps({
        "per_pass_s": per_pass,
        "alloc_retries": retries,
        "stopped": stopped,
        "s_per_step_median": statistics.median(per_step) if per_step else None,
        "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_vram_nvml_gb": None if nvml.peak is None else nvml.peak / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        "linear4bit_modules": n4,
        "unsloth_version": _version("unsloth"),
    }), flush=True)
    return 0


def write_profile(path: Path, step) -> None:
    """Profile `step()` (one optimizer step); its summary to `path` (JSON), the operator table beside it."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, prof = profiled(step, "cuda")
    summary = summarize(prof, time.perf_counter() - t0, top=40)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary) + "\n")
    path.with_suffix(".txt").write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=60))
    print(f"  unsloth: profiled one step ({summary['wall_s']:.2f} s) into {path}", flush=True)


def _version(pkg: str):
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
