"""A module run on N tokens of the sequence at a time (dimension -2), each chunk under non-reentrant
checkpointing where autograd records, the outputs concatenated: the one mechanism of `mlp_chunk`
(poros/engine/model/mlp_chunk.py) and `attention_chunk` (poros/engine/model/attention_chunk.py); and for a result only
backpropagated, the same chunks computed in the backward alone (`deferred_in_chunks`).

LoRA dropout inside a chunk draws its masks under keys of its own (the step and micro-batch of the chunk's first
run, and the chunk's index), pinned for the chunk's recompute: poros may run that recompute on its backward thread
while its own thread has moved the keys on to the next layer (poros/engine/model/dropout.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from poros.engine.model.dropout import DropoutKeys, KeyedDropout


def dropout_keys(module: nn.Module) -> DropoutKeys | None:
    """The keys the LoRA dropout inside `module` draws from (None without `lora_dropout`)."""
    return next((m.keys for m in module.modules() if isinstance(m, KeyedDropout)), None)


def _pin(keys: DropoutKeys | None, k: int) -> tuple | None:
    """The dropout keys chunk k draws under, in its first run and its recompute alike."""
    return None if keys is None else (keys.step, keys.micro, k)


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
        pin = _pin(keys, k)
        if torch.is_grad_enabled():
            # No random state to restore: the chunk draws nothing from the global generators (its LoRA dropout
            # is keyed), and saving it would read the CUDA generator inside a CUDA-graph capture.
            outs.append(checkpoint(_run_chunk, forward, part, keys, pin, use_reentrant=False,
                                   preserve_rng_state=False))
        else:
            outs.append(_run_chunk(forward, part, keys, pin))
    return torch.cat(outs, dim=-2)


def backward_order(n: int):
    """The order autograd runs the backwards of n checkpointed chunks, and sums their gradients in: last first."""
    return reversed(range(n))


class _Deferred(torch.autograd.Function):
    """`run_in_chunks`'s result where its value is read by nothing: the forward computes none (an uninitialised
    tensor of `x`'s shape), the backward runs each chunk's forward and backward, last chunk first, and sums the
    chunks' parameter gradients in that order: the order autograd runs and sums the checkpointed chunks', so
    the gradients are theirs bit for bit (experiments/cpu-deferred-mlp)."""

    @staticmethod
    def forward(ctx, x, forward, chunk, keys, pins, *params):
        ctx.save_for_backward(x)
        ctx.forward, ctx.chunk, ctx.keys, ctx.pins, ctx.params = forward, chunk, keys, pins, params
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        parts, grads = torch.split(x, ctx.chunk, dim=-2), torch.split(grad, ctx.chunk, dim=-2)
        dx, dparams = [None] * len(parts), None
        for k in backward_order(len(parts)):
            with torch.enable_grad():
                part = parts[k].detach().requires_grad_(True)
                out = _run_chunk(ctx.forward, part, ctx.keys, ctx.pins[k])
                got = torch.autograd.grad(out, (part, *ctx.params), grads[k])
            dx[k] = got[0]
            dparams = list(got[1:]) if dparams is None else [a + b for a, b in zip(dparams, got[1:])]
        return (torch.cat(dx, dim=-2), None, None, None, None, *dparams)


def deferred_in_chunks(forward, x: torch.Tensor, chunk: int, keys: DropoutKeys | None,
                       params: list[torch.Tensor]) -> torch.Tensor:
    """`run_in_chunks(forward, x, chunk, keys)` for a caller that only backpropagates the result (its value is
    never read, and `forward` maps `x` to its own shape): nothing is computed until the backward, which computes
    each chunk once, its forward then its backward, where the checkpointed chunks compute it twice. `params`:
    the parameters requiring grad inside `forward`, which receive their gradients as from the checkpointed
    chunks."""
    if x.shape[-2] <= chunk or not torch.is_grad_enabled():
        return run_in_chunks(forward, x, chunk, keys)
    n = -(-x.shape[-2] // chunk)
    pins = [_pin(keys, k) for k in range(n)]
    return _Deferred.apply(x, forward, chunk, keys, pins, *params)
