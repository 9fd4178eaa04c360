"""Unsloth as a third method (GPU only), measured like the others.

Unsloth patches transformers, peft and bitsandbytes globally when imported and when it loads a
model, so every Unsloth cell runs in its own child process (`python -m poros.harness.unsloth`):
the resident and poros cells of the same session keep running stock code. The child loads the
same NF4 weights, written by `poros.store.export` as a pre-quantized bitsandbytes checkpoint, through
FastLanguageModel, adds LoRA on the same projections with Unsloth's default gradient
checkpointing, and trains on the same synthetic batches with the same AdamW. `compile` does not reach it:
Unsloth compiles its own kernels and modules as its users run it (poros/engine/methods/registry.py `config_for`).

The child reports each warm-up and timed pass as it ends (a `WARM` or `PASS` line); the parent's timed-pass
loop, the one every method runs (`poros.harness.timing.timed_rounds`), closes a round on each, so a pass is a
pytest-benchmark round as an in-process pass is, kept as soon as it ends, and a time budget stops the child
between passes. With `keep_export` the export stays in the work folder for the next child on the same weights
(a benchmark in parts), one store at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from poros.common.atomic import write_atomic
from poros.config import Method, TrainConfig
from poros.engine.model.attention import sdpa_context
from poros.engine.methods.data import synthetic_step
from poros.engine.methods.registry import METHODS
from poros.engine.runtime.nvml import NvmlPeak, alloc_retries
from poros.harness.child import emit
from poros.harness.profiling import profiled, summarize
from poros.engine.methods.trainer import deterministic_kernels, enable_determinism
from poros.errors import CapabilityError, PorosError
from poros.store.export import export_bnb4bit

ENV = {
    "HF_HUB_OFFLINE": "1",  # no hub look-ups, statistics or model-name tables
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_DISABLE": "1",  # the checkpoint loader's progress bar: a log line per update in the run's log
}
RESULT = "POROS_UNSLOTH_RESULT "
PASS = "POROS_UNSLOTH_PASS "  # a timed pass ended: its JSON
WARM = "POROS_UNSLOTH_WARM "  # a warm-up pass ended: its JSON (seconds, and the pace of its second half)
EXPORT_PREFIX = "poros-unsloth-export-"  # kept exports (`keep_export`): one folder per store, `complete` when whole


def unavailable(device: str) -> str | None:
    """Why Unsloth cannot run here (None when it can): the method registry's declared gate."""
    return METHODS[Method.UNSLOTH].unavailable(device)


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
    def export(folder: Path) -> None:  # written whole or not at all (a full disk: one line); an empty folder goes
        try:
            export_bnb4bit(store, folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    if not keep:
        folder = Path(tempfile.mkdtemp(prefix="poros-unsloth-", dir=root))
        t0 = time.perf_counter()
        export(folder)
        log(f"  unsloth: exported the NF4 checkpoint to {folder} in {time.perf_counter() - t0:.1f} s")
        return folder
    folder = root / (EXPORT_PREFIX + store_fingerprint(store))
    if (folder / "complete").is_file():
        log(f"  unsloth: the NF4 checkpoint exported earlier is in {folder}")
        return folder
    for other in root.glob(EXPORT_PREFIX + "*"):
        shutil.rmtree(other, ignore_errors=True)
    t0 = time.perf_counter()
    export(folder)
    write_atomic(folder / "complete", "", "the export's completion mark")
    log(f"  unsloth: exported the NF4 checkpoint to {folder} in {time.perf_counter() - t0:.1f} s (kept)")
    return folder


def remove_kept_exports(workdir: str | None = None) -> None:
    """Remove the exports `keep_export` left in the work folder."""
    root = Path(workdir or os.environ.get("POROS_WORKDIR") or tempfile.gettempdir())
    for folder in root.glob(EXPORT_PREFIX + "*"):
        shutil.rmtree(folder, ignore_errors=True)


def offloaded_bytes(config, cfg) -> int:
    """Host memory Unsloth's offloaded gradient checkpointing (`use_gradient_checkpointing="unsloth"`, as its
    users run it) takes in a step: every decoder layer's input of one micro-batch, in bf16."""
    return config.num_hidden_layers * cfg.seq_len * cfg.batch_size * config.hidden_size * 2


def measure_unsloth(store, cfg, steps: int, passes: int, warmup: int, workdir: str | None = None, log=print,
                    on_record=None, profile: Path | None = None, *, warmup_steps: int | None = None,
                    on_pass=None, keep_export: bool = False, benchmark=None, earlier: list[dict] = (),
                    budget=None, before_child=None) -> dict:
    """Export `store`, time Unsloth on it in a child process, remove the export; returns the child's record
    with `per_pass_s` as the parent timed them. `before_child()` runs once the export is written, before the
    child starts (the harness gives the store's host memory back there: the child loads the export).

    Each of the child's passes is one round of the timed-pass loop every method runs (`timed_rounds`: with
    `benchmark`, a pytest-benchmark round): a round ends when the child reports the pass (its `PASS` line), after
    `warmup` discarded passes of `warmup_steps` steps (default `steps`). `earlier`: passes an earlier child timed
    ({"seconds", ...}); only the rest are run. `on_pass(record)` gets each timed pass as it ends ({"seconds", the
    child's own "child_seconds", "alloc_retries", peaks}). `budget` (poros.harness.budget.TimeBudget): no round
    starts that would end past it (`OutOfTime`; judged by the last pass, or the pace of the warm-up's second half),
    the wait for a round ends when it is spent, and the child is stopped. `keep_export`: the export stays for the next call on the same store (`_export`).
    `on_record(record)` runs as soon as the child has reported, before the export is removed (tens of
    GB: removing it takes seconds), so a run cut off during the clean-up keeps its result. With `profile`
    the child then profiles one more step and writes its summary there (JSON, poros/harness/profiling.py)
    and the operator table beside it (`.txt`).

    Raises:
        OutOfTime: the time budget ran out between passes.
        CapabilityError: the child failed, with its last lines.
    """
    from poros.harness.timing import host_load, timed_rounds
    from poros.harness.child import EOF_EVENT, ChildLines

    why = unavailable(cfg.device.value)
    if why:
        raise CapabilityError(why)
    root = Path(workdir or os.environ.get("POROS_WORKDIR") or tempfile.gettempdir())
    todo = passes - len(earlier)
    if todo <= 0:
        raise ValueError(f"measure_unsloth: {len(earlier)} earlier passes leave none of {passes} to time")
    folder, proc, lines = None, None, None
    try:
        folder = _export(store, root, keep_export, log)
        if before_child is not None:
            before_child()
        cmd = [sys.executable, "-m", "poros.harness.unsloth", str(folder), "--steps", str(steps), "--passes",
               str(todo), "--warmup", str(warmup), "--config", json.dumps(cfg.as_dict())]
        if warmup_steps is not None:
            cmd += ["--warmup-steps", str(warmup_steps)]
        if profile is not None:
            cmd += ["--profile", str(profile)]
        env = {**os.environ, **ENV, "UNSLOTH_COMPILE_LOCATION": str(root / "unsloth_compiled_cache")}
        if not cfg.deterministic:  # poros's determinism mode may have set it in this process
            env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # everything the child says goes to the log as it comes: a child cut off by a time budget (Unsloth may
        # compile for minutes) still leaves where it was
        lines = ChildLines(proc, {WARM: "warm", PASS: "pass", RESULT: "result"}, log,
                           show=lambda x: x if x.startswith("  unsloth") else "  unsloth| " + x, budget=budget,
                           what="the Unsloth child")
        pace = {"s_per_step": earlier[-1]["seconds"] / steps if earlier else None}
        reported: dict = {}
        per_pass: list[float] = []

        def failed(what: str) -> CapabilityError:
            proc.wait()
            lines.join()
            return CapabilityError(f"unsloth child failed (exit {proc.returncode}) {what}: " + " | ".join(lines.tail[-8:]))

        def run(i: int) -> None:
            if i >= warmup and budget is not None:
                budget.check("the child's next pass", None if pace["s_per_step"] is None else pace["s_per_step"] * steps)
            kind, payload = lines.next()
            want = "warm" if i < warmup else "pass"
            if kind != want:
                raise failed(f"before its {'warm-up' if i < warmup else f'pass {i - warmup + 1}'} ended")
            reported.clear()
            reported.update(payload)
            pace["s_per_step"] = payload.get("pace") or payload["seconds"] / steps

        def done(i: int, seconds: float | None) -> None:
            if seconds is None:
                return
            per_pass.append(seconds)
            if on_pass is not None:
                on_pass({**reported, "seconds": seconds, "child_seconds": reported["seconds"], "load_avg": host_load()})

        timed_rounds(benchmark, run, warmup, todo, earlier=[r["seconds"] for r in earlier], done=done)
        kind, record = lines.next()
        while kind not in ("result", EOF_EVENT):
            kind, record = lines.next()
        if kind != "result" or proc.wait() != 0:
            raise failed("after its passes")
        lines.join()
        log("  unsloth result: " + json.dumps(record))
        record["per_pass_s"] = per_pass
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
    p = argparse.ArgumentParser(prog="python -m poros.harness.unsloth")
    p.add_argument("checkpoint")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--passes", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, help="steps of each warm-up pass (default: --steps)")
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
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)  # as poros.engine.methods.trainer
        model.train()
        vocab = model.config.vocab_size
        per_pass, retries, step = [], [], 0

        def one_step(step: int) -> torch.Tensor:
            for b in synthetic_step(vocab, cfg.seq_len, cfg.batch_size, cfg.grad_accum, seed=cfg.data_seed, step=step):
                with sdpa_context(cfg.attention, routed=False):  # Unsloth's own attention: fa4 runs as fast here
                    loss = model(input_ids=b.input_ids.cuda(), labels=b.labels.cuda()).loss / cfg.grad_accum
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        wsteps = args.steps if args.warmup_steps is None else args.warmup_steps
        for n in range(args.warmup + args.passes):
            n_steps = wsteps if n < args.warmup else args.steps
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
            kind = "warm-up" if n < args.warmup else f"pass {n - args.warmup + 1}/{args.passes}"
            print(f"  unsloth {kind}: {n_steps} steps in {dt:.2f} s, loss {float(loss) * cfg.grad_accum:.4f}", flush=True)
            if n < args.warmup:
                # its pace is its second half's: Unsloth compiles in its first steps
                pace = (time.perf_counter() - t_half) / (n_steps - n_steps // 2) if t_half > t0 else dt / n_steps
                emit(WARM, {"seconds": dt, "pace": pace})
                continue
            per_pass.append(dt)
            retries.append(alloc_retries("cuda") - retried)
            emit(PASS, {
                "seconds": dt, "alloc_retries": retries[-1],
                "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9,
                "peak_vram_nvml_gb": None if nvml.peak is None else nvml.peak / 1e9,
                "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
                "unsloth_version": _version("unsloth")})
        if args.profile is not None:
            write_profile(args.profile, lambda: one_step(step))
    per_step = [t / args.steps for t in per_pass]
    emit(RESULT, {
        "per_pass_s": per_pass,
        "alloc_retries": retries,
        "s_per_step_median": statistics.median(per_step) if per_step else None,
        "peak_vram_gb": torch.cuda.max_memory_allocated() / 1e9,
        "peak_vram_nvml_gb": None if nvml.peak is None else nvml.peak / 1e9,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
        "linear4bit_modules": n4,
        "unsloth_version": _version("unsloth"),
    })
    return 0


def write_profile(path: Path, step) -> None:
    """Profile `step()` (one optimizer step); its summary to `path` (JSON), the operator table beside it."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, prof = profiled(step, "cuda")
    summary = summarize(prof, time.perf_counter() - t0, top=40)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(summary) + "\n", "the profile")
    write_atomic(path.with_suffix(".txt"), prof.key_averages().table(sort_by="device_time_total", row_limit=60),
                 "the profile's table")
    print(f"  unsloth: profiled one step ({summary['wall_s']:.2f} s) into {path}", flush=True)


def _version(pkg: str):
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
