"""Resident QLoRA training on CPU: the loss goes down, the synthetic data is deterministic,
and gradient accumulation runs one forward/backward per micro-batch."""

from __future__ import annotations

import pytest
import torch

from poros.store.build import build_store
from poros.config import TrainConfig
from poros.engine.methods.data import synthetic_batch, synthetic_step
from tests.capabilities import requires_bitsandbytes


@pytest.fixture(scope="module")
def qwen3_store():
    store, _ = build_store("tiny-qwen3", progress=False)
    return store


@requires_bitsandbytes
def test_resident_training_lowers_loss(qwen3_store):
    from poros.engine.methods.trainer import ResidentTrainer

    # lr 1e-2 overshoots at this size (the loss stalls near ln(vocab)); 3e-3 falls steadily.
    trainer = ResidentTrainer(qwen3_store, TrainConfig(model="tiny-qwen3", seq_len=64, lr=3e-3))
    batches = trainer.batches(0)  # one fixed batch, repeated: the adapters must fit it
    losses = [trainer.step(batches).loss for _ in range(30)]
    assert all(l == l and l > 0 for l in losses), f"non-finite or non-positive loss: {losses}"
    assert losses[-1] < 0.9 * losses[0], f"loss did not fall: first {losses[0]:.4f}, last {losses[-1]:.4f}"
    assert trainer.steps_done == 30
    # Only the LoRA adapters train; the B matrices start at zero and must have moved.
    moved = [n for n, p in trainer.params if ".lora_B." in n and bool(p.detach().abs().sum() > 0)]
    assert moved, "no lora_B weight changed"
    trainer.close()


def test_synthetic_batch_is_deterministic():
    a = synthetic_batch(1024, 64, 2, seed=1234, step=3, micro=1)
    b = synthetic_batch(1024, 64, 2, seed=1234, step=3, micro=1)
    assert a.input_ids.shape == (2, 64) and a.input_ids.dtype == torch.int64
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.labels, a.input_ids), "labels must equal input_ids"
    assert int(a.input_ids.min()) >= 0 and int(a.input_ids.max()) < 1024


@pytest.mark.parametrize(
    "changed",
    [dict(step=4), dict(micro=0), dict(seed=1235)],
    ids=["differs-by=step", "differs-by=micro", "differs-by=seed"],
)
def test_synthetic_batch_changes_with_its_arguments(changed):
    base = dict(seed=1234, step=3, micro=1)
    a = synthetic_batch(1024, 64, 1, **base)
    b = synthetic_batch(1024, 64, 1, **{**base, **changed})
    assert not torch.equal(a.input_ids, b.input_ids)


def test_synthetic_step_is_the_micro_batches_in_order():
    step = synthetic_step(1024, 64, 1, 3, seed=7, step=2)
    assert len(step) == 3
    for m, b in enumerate(step):
        assert torch.equal(b.input_ids, synthetic_batch(1024, 64, 1, seed=7, step=2, micro=m).input_ids)


@requires_bitsandbytes
def test_grad_accum_runs_each_micro_batch(qwen3_store):
    from poros.engine.methods.trainer import ResidentTrainer

    trainer = ResidentTrainer(qwen3_store, TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2))
    seen, losses = [], []
    real = trainer.forward_backward

    def forward_backward(batch):
        seen.append(batch.input_ids.clone())
        losses.append(real(batch))
        return losses[-1]

    trainer.forward_backward = forward_backward
    result = trainer.step()  # step 0 of the synthetic data
    expected = synthetic_step(qwen3_store.config.vocab_size, 64, 1, 2, seed=trainer.cfg.data_seed, step=0)
    assert len(seen) == 2, f"grad_accum=2 ran {len(seen)} micro-batches"
    for m, (got, want) in enumerate(zip(seen, expected)):
        assert torch.equal(got, want.input_ids), f"micro-batch {m} is not synthetic step 0 micro {m}"
    assert not torch.equal(seen[0], seen[1])
    assert trainer.steps_done == 1
    assert result.loss == float(losses[0].float() + losses[1].float())
    trainer.close()
