"""Does a chunked MLP whose forward computes nothing, and whose backward runs each chunk's forward and backward,
give the bits of `mlp_chunk`'s checkpointed chunks? (experiments/cpu-deferred-mlp/README.md)

    PYTHONPATH=. python experiments/cpu-deferred-mlp/probe.py            # chunks summed last to first
    PYTHONPATH=. python experiments/cpu-deferred-mlp/probe.py --forward  # first to last: the control
"""

from __future__ import annotations

import sys

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.registry import make_trainer
from poros.store.build import build_store

CHUNK, SEQ = 32, 128


class Deferred(torch.autograd.Function):
    """forward: no output computed (the caller only backpropagates it); backward: each chunk's forward and backward
    in `order`, parameter gradients summed in that order."""

    @staticmethod
    def forward(ctx, x, forward, order, *params):
        ctx.save_for_backward(x)
        ctx.forward, ctx.order, ctx.params = forward, order, params
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        parts, grads = torch.split(x, CHUNK, dim=-2), torch.split(grad, CHUNK, dim=-2)
        dx, dp = [None] * len(parts), None
        for k in ctx.order(range(len(parts))):
            with torch.enable_grad():
                xc = parts[k].detach().requires_grad_(True)
                got = torch.autograd.grad(ctx.forward(xc), (xc, *ctx.params), grads[k])
            dx[k] = got[0]
            dp = list(got[1:]) if dp is None else [a + b for a, b in zip(dp, got[1:])]
        return (torch.cat(dx, dim=-2), None, None, *dp)


def main(forward_order: bool) -> int:
    store = build_store("tiny-qwen2", seed=0, device="cpu", progress=False)[0]
    cfg = TrainConfig(model="tiny-qwen2", seq_len=SEQ, mlp_chunk=CHUNK)
    trainer = make_trainer(Method.RESIDENT, store, cfg)
    mlp = next(m for n, m in trainer.model.named_modules() if n.endswith("layers.0.mlp"))
    params = [p for p in mlp.parameters() if p.requires_grad]
    torch.manual_seed(1)
    x = torch.randn(1, SEQ, store.config.hidden_size, dtype=torch.bfloat16)
    g = torch.randn_like(x)

    def grads(run):
        for p in params:
            p.grad = None
        leaf = x.clone().requires_grad_(True)
        run(leaf).backward(g)
        return [leaf.grad, *(p.grad for p in params)]

    checkpointed = grads(mlp)  # mlp_chunk's path: each chunk under non-reentrant checkpointing
    order = (lambda r: r) if forward_order else reversed
    own = type(mlp).forward.__get__(mlp)
    deferred = grads(lambda leaf: Deferred.apply(leaf, own, order, *params))
    same = [torch.equal(a, b) for a, b in zip(checkpointed, deferred)]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(checkpointed, deferred))
    print(f"order {'first to last' if forward_order else 'last to first'}: input gradient equal {same[0]}, "
          f"{sum(same[1:])} of {len(params)} LoRA gradients equal, max |diff| {diff:.3e}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main("--forward" in sys.argv))
