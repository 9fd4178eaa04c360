"""`poros train`: fine-tune a local checkpoint on your data and keep an adapter peft loads.

The run folder holds `config.json` (resolved settings, fingerprints of model and data, provenance of
every invocation), `run.yaml` (the resolved configuration as a run file: `poros train --config
RUN/run.yaml --resume` continues the run), `log.csv` and `loss.png`, `checkpoint/` (peft adapter, AdamW state, data position,
RNG states; written every `save_every` steps, at the end and on Ctrl-C) and, at the end, `adapter/`.

Exactness: the batches of step s are a function of (data, seed, s) alone (poros.finetune.data), the
adapter starts from --seed, and a checkpoint holds every tensor the next step reads, so a resumed
run ends torch.equal to an uninterrupted one, and poros and resident (the same arithmetic) end
torch.equal to each other. Settings that would change that arithmetic are refused on --resume.

Under `poros train --gpus N` (or `torchrun --nproc-per-node N -m poros train ...`) the run is data-parallel (poros.engine.parallel.distributed):
each step takes N x batch x grad_accum sequences, every rank trains its contiguous share, and rank 0
alone writes the run folder. The number of ranks is part of the arithmetic (`gpus` in config.json):
--resume refuses another.

`finetune` checks the paths and the run folder (poros.finetune.run_folder), resolves the model, tokenizes the data,
writes the run's records and builds the trainer; the steps run in poros.finetune.loop.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
from pathlib import Path

import torch

from poros.engine.parallel.distributed import any_rank, barrier, init_world, share_store
from poros.engine.methods.registry import make_trainer
from poros.common.atomic import write_atomic
from poros.errors import CheckpointError, ConfigError, PorosError
from poros.finetune.checkpoint import load_checkpoint
from poros.finetune.config import RUN_FILE, FinetuneConfig, dump_run_file
from poros.finetune.data import CACHE_DIR, DataError, file_sha256, load_data
from poros.finetune.tokenizing import load_tokenizer, tokenizer_fingerprint
from poros.finetune.fingerprints import model_fingerprint, weights_fingerprint
from poros.finetune.loop import RunSummary, sequences_per_step, train_loop
from poros.finetune.runlog import Progress, RunLog, restore_signals, signals_held
from poros.finetune.plan_line import dry_plan, plan_line
from poros.finetune.run_folder import check_resume, own_run_folder, prepare_out
from poros.models.targets import describe_targets, layer_linear_names, resolve_targets
from poros.models.checkpoint import resolve
from poros.models.skeleton import check_lora_rank, check_seq_len
from poros.paths import check_input
from poros.provenance import provenance
from poros.store.nf4_checkpoint import is_bnb_checkpoint


def finetune(fc: FinetuneConfig, *, resume: bool = False, progress: bool | None = None,
             resume_command: str | None = None, on_step=None, dry_run: bool = False,
             device_defaults: tuple[str, ...] = ()) -> RunSummary:
    """Run (or, with `resume`, continue) the fine-tuning described by `fc` in `fc.out`, which it owns
    for the run (a second run into it is refused, naming this one).

    Args:
        progress: a bar on stderr (None: only when it is a terminal; False: plain lines).
        resume_command: printed when Ctrl-C (or SIGTERM) stops the run.
        on_step: called with the step number after each optimizer step (tests).
        dry_run: check everything, print the plan and what the data holds on stdout, and return
            before building the model; the run folder is neither locked nor written.
        device_defaults: the settings that took the device's defaults (the plan line names them).
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
            return _finetune(fc, world, resume, progress, resume_command, on_step, Path(scratch), device_defaults)
    try:
        with own_run_folder(fc.out, world):
            return _finetune(fc, world, resume, progress, resume_command, on_step, None, device_defaults)
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


def _finetune(fc, world, resume, progress, resume_command, on_step, scratch, device_defaults) -> RunSummary:
    """The run; a dry run (`scratch`: its folder for tokens) returns before building the model."""
    cfg, out, given, dry_run = fc.train, fc.out, fc, scratch is not None
    before = prepare_out(out, resume, fc.steps)
    barrier(world)  # every rank has checked the folder before rank 0 writes into it
    src = resolve(cfg.model)
    if src.checkpoint is None:
        raise ConfigError([f"{cfg.model} is a registered shape, with no tokenizer or trained weights; pass a "
                           "checkpoint folder (config.json, safetensors and tokenizer files)"], "--model")
    check_seq_len(src.config, cfg.seq_len)
    linears = layer_linear_names(src.config)
    cfg = cfg.replace(lora_targets=resolve_targets(linears, cfg.lora_targets))
    check_lora_rank(src.config, cfg.lora_rank, cfg.lora_targets)
    fc = dataclasses.replace(fc, train=cfg)
    start = before["checkpoint"]["step"] if before is not None else 0
    bar = Progress(fc.steps, start, tty=progress) if world.main and not dry_run else _Quiet()
    tok = load_tokenizer(src.checkpoint)
    record = {"settings": fc.settings(),
              "fingerprints": {"model": model_fingerprint(src.checkpoint), "data": file_sha256(fc.data),
                               "weights": weights_fingerprint(src.checkpoint),
                               "weights_format": "nf4" if is_bnb_checkpoint(src.checkpoint) else "float"}}
    if before is not None:
        check_resume(before, record)
    data, evals = _load_all(fc, tok, src, record["fingerprints"]["data"], world, bar.message, scratch)
    record["data"] = {"records": data.records, "tokens": data.tokens, "sequences": data.blocks}
    if dry_run:
        per_step = sequences_per_step(cfg)
        for line in (plan_line(fc, dry_plan(fc, src), device_defaults),
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
            if (state["step"], state["position"]) != (start, start * sequences_per_step(cfg)):
                raise CheckpointError(f"{out}/checkpoint: step {state['step']} and data position "
                                      f"{state['position']} do not match (expected step {start})")
            trainer.steps_done = start
        record["runs"] = [*(before or {}).get("runs", []), {"from_step": start, "method": fc.method.value,
                                                            "provenance": provenance()}]
        if world.main:
            write_atomic(out / "config.json", json.dumps(record, indent=1, default=str), "the run's record")
            write_atomic(out / RUN_FILE, dump_run_file(dataclasses.replace(given, train=given.train.replace(
                gpus=cfg.gpus))), "the run's settings")
        bar.message(plan_line(fc, getattr(trainer, "plan", None), device_defaults))
        log = RunLog(out / "log.csv", start) if world.main else None
        batches = evals.in_order(cfg.batch_size) if evals is not None else None
        summary = train_loop(fc, trainer, data, batches, start, log, base_model, bar, resume_command, on_step, stats)
        barrier(world)  # rank 0 has written the run folder
        return summary
    finally:
        trainer.close()


def _load_all(fc, tok, src, data_sha, world, say, scratch=None):
    """The training data and the eval batches. Rank 0 tokenizes first (into the cache beside the
    data, or in the run folder where the data's folder is read-only); the other ranks then read it."""

    def load():
        cfg = fc.train
        vocab, tid = src.config.vocab_size, tokenizer_fingerprint(src.checkpoint)
        cache = None if os.access(fc.data.parent, os.W_OK) else (scratch or fc.out) / CACHE_DIR
        data = load_data(fc.data, tok, cfg.seq_len, seed=cfg.seed, vocab_size=vocab, data_sha256=data_sha,
                         tokenizer_id=tid, cache_root=cache, say=say, eval_split=fc.eval_split)
        if data.blocks < sequences_per_step(cfg):  # a step would take some sequences twice
            ranks = f" x gpus {cfg.gpus}" if cfg.gpus > 1 else ""
            raise DataError(f"{fc.data}: {data.blocks} sequences of {cfg.seq_len} tokens, fewer than one step takes "
                            f"(--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}{ranks} = "
                            f"{sequences_per_step(cfg)}), so a step would repeat sequences; lower them or add data")
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


class _Quiet:
    """The progress of a rank other than 0: nothing printed."""

    def message(self, text: str) -> None:
        pass

    def update(self, step: int, loss: float, tokens_per_s: float, memory: str = "") -> None:
        pass
