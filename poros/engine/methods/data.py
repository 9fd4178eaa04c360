"""The `synthetic` dataset: deterministic, license-free random tokens (labels = inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    # on a CUDA device, the token ids as the host had them (`to`): a lookup on the host reads them here instead of
    # copying the device's back, which would wait for everything queued before it
    host_input_ids: torch.Tensor | None = None

    def to(self, device) -> "Batch":
        """The batch on `device`. To a CUDA device each tensor goes through page-locked memory without the host
        waiting for the copy (a pageable copy would wait for every kernel queued before it: the device would run
        dry at each step's start while the host launches the step's first work); the same bytes either way."""
        device = torch.device(device)
        if device.type != "cuda":
            return Batch(self.input_ids.to(device), self.labels.to(device))
        ids, labels = (t if t.is_pinned() else t.pin_memory() for t in (self.input_ids, self.labels))
        return Batch(ids.to(device, non_blocking=True), labels.to(device, non_blocking=True),
                     host_input_ids=self.input_ids if self.input_ids.device.type == "cpu" else None)


def synthetic_batch(vocab_size: int, seq_len: int, batch_size: int, *, seed: int, step: int, micro: int) -> Batch:
    """Micro-batch `micro` of optimizer step `step`; the same arguments give the same tokens."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + micro)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return Batch(ids, ids.clone())


def synthetic_step(vocab_size: int, seq_len: int, batch_size: int, grad_accum: int, *, seed: int, step: int):
    return [synthetic_batch(vocab_size, seq_len, batch_size, seed=seed, step=step, micro=m) for m in range(grad_accum)]
