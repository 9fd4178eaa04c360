"""The steps of a `poros train` run. Each optimizer step trains on the batches of its data position and adds a row
to log.csv; every `save_every` steps, at the last step and at the step a Ctrl-C or SIGTERM arrives in, the LoRA
weights and AdamW state are checked finite, the eval data is scored (`eval_loss`, on every rank) and rank 0 saves a
checkpoint and redraws loss.png. A loss that is not finite stops the run at its step. A finished run writes
`adapter/`; `RunSummary` is what a run returns. A step's loss is read back once the next step is enqueued (a step
that saves, before), so the device never waits for the host between steps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from poros.engine.parallel.distributed import any_rank
from safetensors import SafetensorError

from poros.common.atomic import is_write_failure, written_why
from poros.errors import PorosError, WriteError
from poros.finetune.checkpoint import save_checkpoint, write_adapter
from poros.finetune.runlog import StopRequest, plot_loss


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


def sequences_per_step(cfg) -> int:
    """Sequences one optimizer step takes from the data, over every data-parallel rank."""
    return cfg.gpus * cfg.batch_size * cfg.grad_accum


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


def train_loop(fc, trainer, data, evals, start, log, base_model, bar, resume_command, on_step, stats) -> RunSummary:
    cfg, out, world = fc.train, fc.out, trainer.world
    per_step = sequences_per_step(cfg)
    tokens = per_step * cfg.seq_len
    bar.message(f"poros train: {fc.method.value}, {stats.layers} layers ({_size(stats.store_bytes)} NF4), "
                f"steps {start + 1}-{fc.steps}")
    summary = RunSummary(step=start, interrupted=False)
    again = resume_command or f"poros train ... --out {out} --resume (with this run's settings)"
    saved = start  # the step of the checkpoint on disk
    speeds = []
    memory_kind = "on cuda" if cfg.device.value == "cuda" else "host RSS (cpu)"
    clock = [time.perf_counter()]  # when the last step reported was read back

    def report(done: int, result) -> dict:
        """Step `done`'s row, once its loss is read back (which waits for the step's last kernel)."""
        loss = result.loss
        now = time.perf_counter()
        speeds.append(tokens / (now - clock[0]))
        clock[0] = now
        summary.step = done
        if not math.isfinite(loss):
            raise PorosError(f"step {done}: the loss is {loss}; lower --lr (now {cfg.lr}) and start a new run")
        summary.losses.append(loss)
        peak = _peak_memory_gb(cfg.device.value)
        bar.update(done, loss, speeds[-1], f"peak {peak:.2f} GB {memory_kind}")
        return {"step": done, "loss": f"{loss:.6f}", "lr": lrs.pop(done), "tokens_per_s": f"{speeds[-1]:.1f}",
                "peak_memory_gb": f"{peak:.3f}"}

    def write_failed(e: BaseException, done: int) -> BaseException:
        """A write into the run's folder that failed at step `done`, as one line (a full disk); another error: itself."""
        if not (isinstance(e, WriteError) or is_write_failure(e)):  # a safetensors error of another kind
            return e
        kept = f"the checkpoint of step {saved} is intact" if saved else "no checkpoint was written"
        return PorosError(f"step {done}: writing into {out} failed ({written_why(e)}); {kept}; free space, "
                          f"then resume with: {again}")

    # Each step is enqueued before the last one's loss is read back, so the host prepares a step while the device
    # runs the one before (one synchronization a step, never an idle device); a step that saves is read back
    # before the next is enqueued, so its checkpoint holds that step's weights.
    lrs, pending = {}, None
    with StopRequest(bar.message) as stop:
        for step in range(start, fc.steps):
            batches = data.batches_at(step * per_step, cfg.batch_size, cfg.grad_accum * world.size)
            batches = [b.to(trainer.device) for b in world.share(batches)]
            done = step + 1
            result = trainer.step(batches)
            lrs[done] = trainer.optimizer.param_groups[0]["lr"]
            if on_step:
                on_step(done)
            last = done == fc.steps
            stopping = any_rank(stop.requested, world)
            saving = last or stopping or (fc.save_every and done % fc.save_every == 0)
            if pending is not None:
                row = report(*pending)
                if world.main:
                    try:
                        log.append(row)
                    except (OSError, WriteError) as e:
                        failure = write_failed(e, pending[0])
                        if failure is e:
                            raise
                        raise failure from None
            pending = (done, result)
            if not saving:
                continue
            row, pending = report(*pending), None
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
                if world.main:
                    save_checkpoint(trainer, out, {"step": done, "position": done * per_step,
                                                   "loss": summary.losses[-1]}, base_model)
                    saved = done
                    if stopping:
                        stop.settle()  # the checkpoint is saved: a second Ctrl-C has nothing left to abort
                    log.append(row)
                    plot_loss(log, out / "loss.png")
            except (OSError, WriteError, SafetensorError) as e:  # a full disk: one line, the last checkpoint intact
                failure = write_failed(e, done)
                if failure is e:
                    raise
                raise failure from None
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
        except (OSError, SafetensorError) as e:
            if not is_write_failure(e):
                raise
            raise PorosError(f"writing {out / 'adapter'} failed ({written_why(e)}); the same adapter is in "
                             f"{out / 'checkpoint' / 'adapter'} (step {saved})") from None
        bar.message(f"done: adapter in {summary.adapter} (PeftModel.from_pretrained(base_model, "
                    f"{summary.adapter!r}))")
    return summary
