"""A module run on N tokens of the sequence at a time (dimension -2), each chunk under non-reentrant
checkpointing where autograd records, the outputs concatenated: the one mechanism of `mlp_chunk`
(poros/engine/mlp_chunk.py) and `attention_chunk` (poros/engine/attention_chunk.py).

LoRA dropout inside a chunk draws its masks under keys of its own (the step and micro-batch of the chunk's first
run, and the chunk's index), pinned for the chunk's recompute: poros may run that recompute on its backward thread
while its own thread has moved the keys on to the next layer (poros/engine/dropout.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from poros.engine.dropout import DropoutKeys, KeyedDropout


def dropout_keys(module: nn.Module) -> DropoutKeys | None:
    """The keys the LoRA dropout inside `module` draws from (None without `lora_dropout`)."""
    return next((m.keys for m in module.modules() if isinstance(m, KeyedDropout)), None)


def _run_chunk(forward, x: torch.Tensor, keys: DropoutKeys | None, pin: tuple | None) -> torch.Tensor:
    """`forward` on one chunk, its dropout masks drawn under `pin` (the same in its recompute)."""
    if keys is None:
        return forward(x)
    with keys.pinned(*pin):
        return forward(x)


def run_in_chunks(forward, x: torch.Tensor, chunk: int, keys: DropoutKeys | None) -> torch.Tensor:
    """`forward(x)` computed `chunk` tokens of `x` at a time (the whole of `x` at once where it is no longer),
    each chunk checkpointed where autograd records; `keys`: the dropout keys inside `forward` (`dropout_keys`)."""
    if x.shape[-2] <= chunk:
        return forward(x)
    outs = []
    for k, part in enumerate(torch.split(x, chunk, dim=-2)):
        pin = None if keys is None else (keys.step, keys.micro, k)
        if torch.is_grad_enabled():
            # No random state to restore: the chunk draws nothing from the global generators (its LoRA dropout
            # is keyed), and saving it would read the CUDA generator inside a CUDA-graph capture.
            outs.append(checkpoint(_run_chunk, forward, part, keys, pin, use_reentrant=False,
                                   preserve_rng_state=False))
        else:
            outs.append(_run_chunk(forward, part, keys, pin))
    return torch.cat(outs, dim=-2)
