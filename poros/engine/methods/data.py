"""The `synthetic` dataset: deterministic, license-free random tokens (labels = inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.labels.to(device))


def synthetic_batch(vocab_size: int, seq_len: int, batch_size: int, *, seed: int, step: int, micro: int) -> Batch:
    """Micro-batch `micro` of optimizer step `step`; the same arguments give the same tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return Batch(ids, ids.clone())


def synthetic_step(vocab_size: int, seq_len: int, batch_size: int, grad_accum: int, *, seed: int, step: int):
    return [synthetic_batch(vocab_size, seq_len, batch_size, seed=seed, step=step, micro=m) for m in range(grad_accum)]
