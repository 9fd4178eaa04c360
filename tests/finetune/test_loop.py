"""The order in which `train_loop` enqueues steps and reads their losses back: each step is enqueued before the last
one's loss is read (the host prepares a step while the device runs the one before), and a step that saves is read back
and saved before the next is enqueued (its checkpoint holds that step's weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import poros.finetune.loop as loop
from poros.engine.parallel.distributed import SINGLE
from poros.errors import PorosError


class Recorded:
    """A step's result whose loss, when read, is noted in `events`."""

    def __init__(self, step: int, loss: float, events: list):
        self.step, self._loss, self.events = step, loss, events

    @property
    def loss(self) -> float:
        self.events.append(("read", self.step))
        return self._loss


class Trainer:
    """Steps that note when they are enqueued; losses 1/step, or NaN at step `nan_at`."""

    def __init__(self, events: list, nan_at: int | None = None):
        self.events, self.nan_at, self.steps, self.world, self.device = events, nan_at, 0, SINGLE, "cpu"
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 1e-4}])

    def step(self, batches):
        self.steps += 1
        self.events.append(("step", self.steps))
        return Recorded(self.steps, float("nan") if self.steps == self.nan_at else 1 / self.steps, self.events)


def run(monkeypatch, tmp_path, steps: int, save_every: int, nan_at: int | None = None) -> tuple[list, list]:
    events, log = [], []
    monkeypatch.setattr(loop, "save_checkpoint", lambda trainer, out, state, base: events.append(("save", state["step"])))
    monkeypatch.setattr(loop, "plot_loss", lambda *a: None)
    monkeypatch.setattr(loop, "write_adapter", lambda trainer, path, base: path)
    monkeypatch.setattr(loop, "_non_finite", lambda trainer: None)
    cfg = SimpleNamespace(batch_size=1, grad_accum=1, seq_len=64, device=SimpleNamespace(value="cpu"), lr=1e-4)
    fc = SimpleNamespace(train=cfg, out=tmp_path, steps=steps, save_every=save_every, method=SimpleNamespace(value="poros"))
    data = SimpleNamespace(batches_at=lambda position, batch, n: [])
    bar = SimpleNamespace(message=lambda *a: None, update=lambda *a: None)
    stats = SimpleNamespace(layers=2, store_bytes=1)
    monkeypatch.setattr(loop, "sequences_per_step", lambda cfg: 1)
    loop.train_loop(fc, Trainer(events, nan_at), data, None, 0, log, None, bar, None, None, stats)
    return events, log


def test_each_step_is_enqueued_before_the_last_one_s_loss_is_read(monkeypatch, tmp_path):
    events, log = run(monkeypatch, tmp_path, steps=4, save_every=0)
    assert events == [("step", 1), ("step", 2), ("read", 1), ("step", 3), ("read", 2), ("step", 4), ("read", 3),
                      ("read", 4), ("save", 4)]
    assert [r["step"] for r in log] == [1, 2, 3, 4] and log[1]["loss"] == f"{1 / 2:.6f}"


def test_a_step_that_saves_is_read_and_saved_before_the_next_is_enqueued(monkeypatch, tmp_path):
    """Control for the order above: with a checkpoint every 2 steps, step 2 is read and saved before step 3."""
    events, _ = run(monkeypatch, tmp_path, steps=4, save_every=2)
    assert events.index(("save", 2)) < events.index(("step", 3))
    assert events.index(("read", 2)) < events.index(("save", 2))


def test_a_loss_read_late_still_names_its_own_step(monkeypatch, tmp_path):
    with pytest.raises(PorosError, match="step 2: the loss is nan"):
        run(monkeypatch, tmp_path, steps=4, save_every=0, nan_at=2)
