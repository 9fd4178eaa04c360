"""`poros train`: fine-tune a local checkpoint on your data and keep an adapter peft loads.

The run folder holds `config.json` (resolved settings, fingerprints of model and data, provenance of
every invocation), `run.yaml` (the resolved configuration as a run file: `poros train --config
RUN/run.yaml --resume` continues the run), `log.csv` and `loss.png`, `checkpoint/` (peft adapter, AdamW state, data position,
RNG states; written every `save_every` steps, at the end and on Ctrl-C) and, at the end, `adapter/`.

Exactness: the batches of step s are a function of (data, seed, s) alone (poros.finetune.data), the
adapter starts from --seed, and a checkpoint holds every tensor the next step reads, so a resumed
run ends torch.equal to an uninterrupted one, and poros and resident (the same arithmetic) end
torch.equal to each other. Settings that would change that arithmetic are refused on --resume.

Under `poros train --gpus N` (or `torchrun --nproc-per-node N -m poros train ...`) the run is data-parallel (poros.engine.distributed):
each step takes N x batch x grad_accum sequences, every rank trains its contiguous share, and rank 0
alone writes the run folder. The number of ranks is part of the arithmetic (`gpus` in config.json):
--resume refuses another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from poros.common.folders import LOCK_NAME, OutputInUse, OutputLock
from poros.config import BY_NAME, COMPUTED_NAMES
from poros.engine.distributed import any_rank, barrier, init_world, share_store
from poros.engine.methods import make_trainer
from poros.errors import CheckpointError, ConfigError, PorosError
from poros.finetune.checkpoint import (  # noqa: F401  (write_adapter, save_checkpoint: re-exported)
    check_checkpoint, load_checkpoint, recover_checkpoint, save_checkpoint, write_adapter)
from poros.finetune.config import RUN_FILE, FinetuneConfig, dump_run_file  # noqa: F401  (FinetuneConfig: re-exported)
from poros.finetune.data import CACHE_DIR, DataError, file_sha256, load_data
from poros.finetune.tokenizing import load_tokenizer, tokenizer_fingerprint
from poros.finetune.fingerprints import model_fingerprint, weights_fingerprint
from poros.finetune.runlog import Progress, RunLog, StopRequest, plot_loss, restore_signals, signals_held
from poros.finetune.plan_line import dry_plan, plan_line
from poros.finetune.targets import describe_targets, layer_linear_names, resolve_targets
from poros.models.checkpoint import resolve
from poros.models.skeleton import check_seq_len
from poros.paths import check_input
from poros.provenance import provenance
from poros.store.nf4_checkpoint import is_bnb_checkpoint

# settings that change what a step computes (--seed also draws the LoRA init and the data order);
# --resume refuses a change to any of them and accepts new schedule settings
EXACT_FIELDS = (*COMPUTED_NAMES, "seed", "device")


@dataclass
class RunSummary:
    step: int  # optimizer steps done
    interrupted: bool
    signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM)
    losses: list[float] = field(default_factory=list)  # this invocation's steps
    tokens_per_s: float | None = None  # median over this invocation's steps
    peak_memory_gb: float | None = None
    eval_loss: float | None = None
    adapter: str | None = None

    def json(self) -> str:
        out = {k: v for k, v in self.__dict__.items() if k != "losses"}
        return json.dumps(out | {"loss_first": self.losses[0] if self.losses else None,
                                 "loss_last": self.losses[-1] if self.losses else None})


# --- fingerprints and the run folder -----------------------------------------------------------


def _prepare_out(out: Path, resume: bool, steps: int) -> dict | None:
    """Check the run folder; on resume return its config.json (settings of the run so far) with the
    checkpoint's state.json under "checkpoint"."""
    if not resume:
        if out.exists() and (not out.is_dir() or any(p.name != LOCK_NAME for p in out.iterdir())):
            if (out / "config.json").is_file():
                raise ConfigError([f"{out} holds another run (config.json, checkpoint/); pass --resume to continue "
                                   "it or choose another --out"], "--out")
            raise ConfigError([f"{out} is not an empty folder; choose a new or empty --out"], "--out")
        return None
    if not (out / "config.json").is_file():
        raise ConfigError([f"{out} holds no run (no config.json); leave out --resume to start one"], "--resume")
    recover_checkpoint(out)
    if not (out / "checkpoint").is_dir():
        raise ConfigError([f"{out} has no checkpoint (checkpoint/state.json) to continue from; start again in a "
                           "new --out"], "--resume")
    before = _run_record(out / "config.json")
    before["checkpoint"] = check_checkpoint(out)
    if steps <= before["checkpoint"]["step"]:
        raise ConfigError([f"the run in {out} is already at step {before['checkpoint']['step']}, got --steps "
                           f"{steps}; raise --steps to train further"], "--steps")
    return before


def _run_record(path: Path) -> dict:
    """A run folder's config.json, as --resume reads it (its settings and fingerprints).

    Raises:
        CheckpointError: a record that is not one (the run cannot be checked, so it is not continued).
    """
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        record, why = None, f"not readable JSON ({str(e).splitlines()[0][:80]})"
    else:
        why = "expected the run's settings and fingerprints"
    ok = isinstance(record, dict) and isinstance(record.get("settings"), dict) and \
        isinstance(record["settings"].get("train"), dict) and isinstance(record.get("fingerprints"), dict)
    if not ok:
        raise CheckpointError(f"{path}: {why}; the run's settings cannot be checked, so it cannot resume: start "
                              f"again in a new --out ({path.parent} is left as it is)")
    return record


def _as_recorded(value):
    """A setting's value as config.json records it (TrainConfig.as_dict)."""
    return value.value if isinstance(value, enum.Enum) else list(value) if isinstance(value, tuple) else value


def _check_resume(before: dict, now: dict) -> None:
    """Name every setting whose change would break exactness."""
    diffs = []
    for k in EXACT_FIELDS:  # a setting newer than the run reads as its default
        a = before["settings"]["train"].get(k, _as_recorded(BY_NAME[k].default) if k in BY_NAME else None)
        b = now["settings"]["train"].get(k)
        if a != b:
            diffs.append(f"{k} {a} (now {b})")
    a, b = before["settings"].get("eval_split"), now["settings"]["eval_split"]
    if a != b:  # which records train and which are held out
        diffs.append(f"eval_split {a} (now {b})")
    for k in ("model", "data"):
        a, b = before["fingerprints"].get(k), now["fingerprints"][k]
        if a != b:
            diffs.append(f"{k} {now['settings'][k]} (other content than the run's: sha256 {b[:12]}, was {a[:12]})")
    a, b = before["fingerprints"].get("weights"), now["fingerprints"]["weights"]
    if a is not None and a != b and before["fingerprints"].get("model") == now["fingerprints"]["model"]:
        diffs.append(f"model {now['settings']['model']} (other weights than the run's base, in files of the same "
                     f"names and sizes: sampled sha256 {b[:12]}, was {a[:12]})")
    if diffs:
        raise ConfigError([f"settings differ from the run in {now['settings']['out']} and would change its result: "
                           f"{', '.join(diffs)}; use the run's settings (its run.yaml: poros train --config "
                           f"{now['settings']['out']}/run.yaml --resume) or a new --out"], "--resume")


# --- the run -----------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _peak_memory_gb(device: str) -> float:
    """Peak device memory torch allocated (cuda), else the process's peak resident set (cpu)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def eval_loss(trainer, batches) -> float:
    """Mean loss per learned token over `batches`, run grad_accum micro-batches at a time as a step
    runs them; the gradients it makes are dropped, so training continues exactly as without it
    (gradients are None between optimizer steps)."""
    accum = trainer.cfg.grad_accum
    total, count = 0.0, 0
    keys = trainer.qlora.dropout_keys
    keys.enabled = False  # the eval loss is the model's, without LoRA dropout
    try:
        for i in range(0, len(batches) - accum + 1, accum):
            group = [b.to(trainer.device) for b in batches[i : i + accum]]
            losses = trainer.accumulate(group)
            for _, p in trainer.params:
                p.grad = None
            for b, loss in zip(group, losses):
                n = int((b.labels[:, 1:] != -100).sum())
                total, count = total + float(loss) * accum * n, count + n
    finally:
        keys.enabled = True
    return total / count


def finetune(fc: FinetuneConfig, *, resume: bool = False, progress: bool | None = None,
             resume_command: str | None = None, on_step=None, dry_run: bool = False,
             cuda_defaults: tuple[str, ...] = ()) -> RunSummary:
    """Run (or, with `resume`, continue) the fine-tuning described by `fc` in `fc.out`, which it owns
    for the run (a second run into it is refused, naming this one).

    Args:
        progress: a bar on stderr (None: only when it is a terminal; False: plain lines).
        resume_command: printed when Ctrl-C (or SIGTERM) stops the run.
        on_step: called with the step number after each optimizer step (tests).
        dry_run: check everything, print the plan and what the data holds on stdout, and return
            before building the model; the run folder is neither locked nor written.
        cuda_defaults: the settings that took the GPU's defaults (the plan line names them).
    Raises:
        PorosError: bad data, model folder, run folder or resume settings, each as one line.
    """

    check_paths(fc)
    world = init_world(fc.train.device.value)
    if world.distributed:
        if fc.train.gpus not in (1, world.size):
            raise ConfigError([f"gpus {fc.train.gpus}, but this process is one of {world.size} ranks; give the same "
                               "number (or leave gpus out under torchrun)"], "gpus")
        fc = dataclasses.replace(fc, train=fc.train.replace(gpus=world.size))
    elif fc.train.gpus > 1 and not dry_run:
        raise ConfigError([f"gpus {fc.train.gpus} needs one process a rank: run `poros train --gpus "
                           f"{fc.train.gpus}` (it starts them) or torchrun --nproc-per-node {fc.train.gpus} -m poros "
                           "train"], "gpus")
    if dry_run:  # tokens of data in a read-only folder go to a scratch folder, removed after
        with tempfile.TemporaryDirectory(prefix="poros-dry-run-") as scratch:
            return _finetune(fc, world, resume, progress, resume_command, on_step, Path(scratch), cuda_defaults)
    try:
        with own_run_folder(fc.out, world):
            return _finetune(fc, world, resume, progress, resume_command, on_step, None, cuda_defaults)
    finally:
        if signals_held():  # stopped by a signal: what the run left is collected while signals are ignored
            gc.collect()
            restore_signals()


def check_paths(fc: FinetuneConfig) -> None:
    """The run's data and folder paths name something to read (not a FIFO, which would never end, nor a loop of
    symbolic links); a missing data file is said where the data is read.

    Raises:
        PorosError: naming the flag and the path.
    """
    for path, flag in ((fc.data, "--data"), (fc.eval_data, "--eval-data"), (fc.out, "--out")):
        if path is not None:
            check_input(path, flag)


@contextlib.contextmanager
def own_run_folder(out: Path, world):
    """Hold the run folder's lock (poros.common.folders.OutputLock, rank 0) for the run; a folder
    the run created and left empty (a refused run) is removed again."""
    created = not out.exists()
    lock, problem = None, None
    if world.main:
        lock = OutputLock(out)
        try:
            lock.acquire()
        except OutputInUse as e:
            problem = OutputInUse(str(e).replace("pass another -o", "pass another --out"))
        except PorosError as e:
            problem = e
    if any_rank(problem is not None, world):
        raise problem or PorosError(f"rank 0 cannot take the run folder {out}")
    try:
        if lock is not None and lock.stale_warning():
            print(lock.stale_warning(), file=sys.stderr, flush=True)
        yield
    finally:
        if lock is not None:
            lock.release()
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()


def _finetune(fc, world, resume, progress, resume_command, on_step, scratch, cuda_defaults) -> RunSummary:
    """The run; a dry run (`scratch`: its folder for tokens) returns before building the model."""
    cfg, out, given, dry_run = fc.train, fc.out, fc, scratch is not None
    before = _prepare_out(out, resume, fc.steps)
    barrier(world)  # every rank has checked the folder before rank 0 writes into it
    src = resolve(cfg.model)
    if src.checkpoint is None:
        raise ConfigError([f"{cfg.model} is a registered shape, with no tokenizer or trained weights; pass a "
                           "checkpoint folder (config.json, safetensors and tokenizer files)"], "--model")
    check_seq_len(src.config, cfg.seq_len)
    linears = layer_linear_names(src.config)
    cfg = cfg.replace(lora_targets=resolve_targets(linears, cfg.lora_targets))
    fc = dataclasses.replace(fc, train=cfg)
    start = before["checkpoint"]["step"] if before is not None else 0
    bar = Progress(fc.steps, start, tty=progress) if world.main and not dry_run else _Quiet()
    tok = load_tokenizer(src.checkpoint)
    record = {"settings": fc.settings(),
              "fingerprints": {"model": model_fingerprint(src.checkpoint), "data": file_sha256(fc.data),
                               "weights": weights_fingerprint(src.checkpoint),
                               "weights_format": "nf4" if is_bnb_checkpoint(src.checkpoint) else "float"}}
    if before is not None:
        _check_resume(before, record)
    data, evals = _load_all(fc, tok, src, record["fingerprints"]["data"], world, bar.message, scratch)
    record["data"] = {"records": data.records, "tokens": data.tokens, "sequences": data.blocks}
    if dry_run:
        per_step = _sequences_per_step(cfg)
        for line in (plan_line(fc, dry_plan(fc, src), cuda_defaults),
                     *(d.description for d in (data, evals) if d is not None),
                     f"steps {start + 1}-{fc.steps}: {per_step} sequences of {cfg.seq_len} tokens a step, "
                     f"{(fc.steps - start) * per_step / data.blocks:.2f} passes over the data; "
                     f"{describe_targets(linears, cfg.lora_targets)} (rank {cfg.lora_rank})"):
            print(line, flush=True)
        return RunSummary(step=start, interrupted=False)
    base_model = record["settings"]["model"]
    for line in (data.description, *([evals.description] if evals is not None else [])):
        bar.message(line)
    bar.message(f"poros train: {describe_targets(linears, cfg.lora_targets)} (rank {cfg.lora_rank}); "
                f"loading {src.name} on {cfg.device.value}")
    store, stats = share_store(src, seed=cfg.seed, device=cfg.device.value, world=world,
                               progress=progress if world.main else False, double_quant=cfg.double_quant)
    if cfg.device.value == "cuda":  # the log's peak is training's, not the build's
        torch.cuda.reset_peak_memory_stats()
    trainer = make_trainer(fc.method, store, cfg, world)
    try:
        if before is not None:
            state = load_checkpoint(trainer, out / "checkpoint")
            if (state["step"], state["position"]) != (start, start * _sequences_per_step(cfg)):
                raise CheckpointError(f"{out}/checkpoint: step {state['step']} and data position "
                                      f"{state['position']} do not match (expected step {start})")
            trainer.steps_done = start
        record["runs"] = [*(before or {}).get("runs", []), {"from_step": start, "method": fc.method.value,
                                                            "provenance": provenance()}]
        if world.main:
            _write_atomic(out / "config.json", json.dumps(record, indent=1, default=str))
            _write_atomic(out / RUN_FILE, dump_run_file(dataclasses.replace(given, train=given.train.replace(
                gpus=cfg.gpus))))
        bar.message(plan_line(fc, getattr(trainer, "plan", None), cuda_defaults))
        log = RunLog(out / "log.csv", start) if world.main else None
        batches = evals.in_order(cfg.batch_size) if evals is not None else None
        summary = _loop(fc, trainer, data, batches, start, log, base_model, bar, resume_command, on_step, stats)
        barrier(world)  # rank 0 has written the run folder
        return summary
    finally:
        trainer.close()


def _write_atomic(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never a part (a full disk fails the write, not the file)."""
    tmp = path.with_name(path.name + ".partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PorosError(f"{path}: cannot be written ({e.strerror or e}); free space or pass another --out") from None


def _load_all(fc, tok, src, data_sha, world, say, scratch=None):
    """The training data and the eval batches. Rank 0 tokenizes first (into the cache beside the
    data, or in the run folder where the data's folder is read-only); the other ranks then read it."""

    def load():
        cfg = fc.train
        vocab, tid = src.config.vocab_size, tokenizer_fingerprint(src.checkpoint)
        cache = None if os.access(fc.data.parent, os.W_OK) else (scratch or fc.out) / CACHE_DIR
        data = load_data(fc.data, tok, cfg.seq_len, seed=cfg.seed, vocab_size=vocab, data_sha256=data_sha,
                         tokenizer_id=tid, cache_root=cache, say=say, eval_split=fc.eval_split)
        if data.blocks < _sequences_per_step(cfg):  # a step would take some sequences twice
            ranks = f" x gpus {cfg.gpus}" if cfg.gpus > 1 else ""
            raise DataError(f"{fc.data}: {data.blocks} sequences of {cfg.seq_len} tokens, fewer than one step takes "
                            f"(--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}{ranks} = "
                            f"{_sequences_per_step(cfg)}), so a step would repeat sequences; lower them or add data")
        evals, flag = data.held_out, "--eval-split"
        if fc.eval_data is not None:
            cache = None if os.access(fc.eval_data.parent, os.W_OK) else (scratch or fc.out) / CACHE_DIR
            evals, flag = load_data(fc.eval_data, tok, cfg.seq_len, seed=cfg.seed, vocab_size=vocab,
                                    tokenizer_id=tid, cache_root=cache, say=say), "--eval-data"
        if evals is not None and len(evals.in_order(cfg.batch_size)) < cfg.grad_accum:
            held = fc.eval_data or f"the eval split {fc.eval_split} of {fc.data}"
            raise ConfigError([f"{held} holds fewer sequences than one step (--batch-size {cfg.batch_size} x "
                               f"--grad-accum {cfg.grad_accum})" + ("; raise --eval-split" if fc.eval_split else "")],
                              flag)
        return data, evals

    if not world.distributed:
        return load()
    failed = None
    if world.main:
        try:
            loaded = load()
        except PorosError as e:
            failed = e
    if any_rank(failed is not None, world):
        raise failed or PorosError("rank 0 could not read the data")
    return loaded if world.main else load()


def _sequences_per_step(cfg) -> int:
    """Sequences one optimizer step takes from the data, over every data-parallel rank."""
    return cfg.gpus * cfg.batch_size * cfg.grad_accum


class _Quiet:
    """The progress of a rank other than 0: nothing printed."""

    def message(self, text: str) -> None:
        pass

    def update(self, step: int, loss: float, tokens_per_s: float, memory: str = "") -> None:
        pass


def _non_finite(trainer) -> str | None:
    """The first LoRA weight or AdamW state tensor holding NaN/inf, by name (None: all finite)."""
    for name, p in trainer.params:
        if not bool(torch.isfinite(p).all()):
            return name
    names = {id(p): n for n, p in trainer.params}
    for p, state in trainer.optimizer.state.items():
        for k, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                return f"AdamW {k} of {names.get(id(p), '?')}"
    return None


def _loop(fc, trainer, data, evals, start, log, base_model, bar, resume_command, on_step, stats) -> RunSummary:
    cfg, out, world = fc.train, fc.out, trainer.world
    per_step = _sequences_per_step(cfg)
    tokens = per_step * cfg.seq_len
    bar.message(f"poros train: {fc.method.value}, {stats.layers} layers ({_size(stats.store_bytes)} NF4), "
                f"steps {start + 1}-{fc.steps}")
    summary = RunSummary(step=start, interrupted=False)
    again = resume_command or f"poros train ... --out {out} --resume (with this run's settings)"
    saved = start  # the step of the checkpoint on disk
    speeds = []
    memory_kind = "on cuda" if cfg.device.value == "cuda" else "host RSS (cpu)"
    with StopRequest(bar.message) as stop:
        for step in range(start, fc.steps):
            t0 = time.perf_counter()
            batches = data.batches_at(step * per_step, cfg.batch_size, cfg.grad_accum * world.size)
            batches = [b.to(trainer.device) for b in world.share(batches)]
            result = trainer.step(batches)
            speeds.append(tokens / (time.perf_counter() - t0))
            done = summary.step = step + 1
            if not math.isfinite(result.loss):
                raise PorosError(f"step {done}: the loss is {result.loss}; lower --lr (now {cfg.lr}) and start a new "
                                 "run")
            summary.losses.append(result.loss)
            peak = _peak_memory_gb(cfg.device.value)
            row = {"step": done, "loss": f"{result.loss:.6f}", "lr": trainer.optimizer.param_groups[0]["lr"],
                   "tokens_per_s": f"{speeds[-1]:.1f}", "peak_memory_gb": f"{peak:.3f}"}
            bar.update(done, result.loss, speeds[-1], f"peak {peak:.2f} GB {memory_kind}")
            if on_step:
                on_step(done)
            last = done == fc.steps
            stopping = any_rank(stop.requested, world)
            saving = last or stopping or (fc.save_every and done % fc.save_every == 0)
            if saving:
                bad = _non_finite(trainer)
                if bad is not None:
                    kept = f"the checkpoint of step {saved} is kept" if saved else "no checkpoint was written"
                    raise PorosError(f"step {done}: {bad} holds NaN/inf after the update, so it is not saved ({kept}); "
                                     f"lower --lr (now {cfg.lr}) and start a new run")
                if evals is not None:  # every rank scores the whole eval set (its collectives run on all)
                    summary.eval_loss = eval_loss(trainer, evals)
                    row["eval_loss"] = f"{summary.eval_loss:.6f}"
                    bar.message(f"step {done}: eval loss {summary.eval_loss:.4f}")
            try:
                if saving and world.main:
                    save_checkpoint(trainer, out, {"step": done, "position": done * per_step, "loss": result.loss},
                                    base_model)
                    saved = done
                    if stopping:
                        stop.settle()  # the checkpoint is saved: a second Ctrl-C has nothing left to abort
                    log.append(row)
                    plot_loss(log, out / "loss.png")
                elif world.main:
                    log.append(row)
            except OSError as e:  # a full disk, most often: one line, the last checkpoint intact
                kept = f"the checkpoint of step {saved} is intact" if saved else "no checkpoint was written"
                raise PorosError(f"step {done}: writing into {out} failed ({e.strerror or e}); {kept}; free space, "
                                 f"then resume with: {again}") from None
            if stopping and not last:
                stop.settle()  # (the other ranks, which save nothing)
                summary.interrupted, summary.signal = True, stop.signum
                bar.message(f"stopped at step {done}/{fc.steps}; checkpoint saved in {out / 'checkpoint'}; "
                            f"resume with:\n  {again}")
                break
    timed = sorted(speeds[1:] or speeds)  # the first step carries the warm-up
    summary.tokens_per_s = timed[len(timed) // 2] if timed else None
    summary.peak_memory_gb = _peak_memory_gb(cfg.device.value)
    if not summary.interrupted and world.main:
        try:
            summary.adapter = str(write_adapter(trainer, out / "adapter", base_model))
        except OSError as e:
            raise PorosError(f"writing {out / 'adapter'} failed ({e.strerror or e}); the same adapter is in "
                             f"{out / 'checkpoint' / 'adapter'} (step {saved})") from None
        bar.message(f"done: adapter in {summary.adapter} (PeftModel.from_pretrained(base_model, "
                    f"{summary.adapter!r}))")
    return summary
