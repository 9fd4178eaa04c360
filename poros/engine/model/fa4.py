"""FlashAttention-4 (`attention: fa4`): the one module that touches its code.

Checked against flash-attn-4 4.0.0b40 (`flash_attn/cute/interface.py`), whose own autograd Function
(`FlashAttnFunc`, behind `flash_attn_func`) makes these two calls:
- `_flash_attn_fwd(q, k, v, softmax_scale=, causal=, return_lse=True)` returns (out, lse, ...): out
  (batch, seqlen, heads, head_dim_v) in the inputs' dtype, lse (batch, heads, seqlen) float32;
- `_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, deterministic=)` returns (dq, dk, dv), each like
  its input; `deterministic` orders the dQ (and grouped dK/dV) accumulation with semaphores, so two runs give the
  same bits.
Inputs are (batch, seqlen, heads, head_dim), grouped key/value heads by fewer heads in k and v; the interface makes
them contiguous and 16-byte aligned itself where they are not.

Each call is a torch custom op (`poros::fa4_forward`, `poros::fa4_backward`) with a fake implementation, so that a
torch.compile'd layer keeps it in its graph (FA4's own autograd Function would break the graph), and autograd
registered on the forward: its backward saves q, k, v, out and lse and calls the backward op. The ops run FA4's
kernels through `KERNEL`, which tests replace with a reference in the same layout.

What a call needs to be routed here (`serves`): CUDA tensors of bf16 or fp16, four dimensions in SDPA's layout, no
mask (causal or none) and no dropout, as many or a multiple of the key/value heads (with `enable_gqa`), causal only
where queries and keys are equally long (FA4 aligns a causal mask to the bottom right, SDPA to the top left: they
agree on square calls alone), and head dims every FA4 architecture takes: 8 to 128 in steps of 8 (q/k and v alike),
(192, 128) or (256, 256). Every other call runs SDPA's `fast` list (poros/engine/model/attention.py).
"""

from __future__ import annotations

import math

import torch

VERSION = "4.0.0b40"  # the flash-attn-4 release this module's calls were checked against
DTYPES = (torch.bfloat16, torch.float16)


class FlashAttention4:
    """FA4's forward and backward kernels (imported on first use: cutlass, TVM-FFI and the CUDA bindings)."""

    device = "cuda"

    def __init__(self):
        self._interface = None

    def interface(self):
        if self._interface is None:
            from flash_attn.cute import interface

            self._interface = interface
        return self._interface

    def forward(self, q, k, v, scale: float, causal: bool):
        out, lse = self.interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)[:2]
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool):
        dq, dk, dv = self.interface()._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal,
                                                      deterministic=deterministic)[:3]
        return dq, dk, dv


KERNEL = FlashAttention4()  # what the ops run; tests put a reference kernel of the same layout here


def head_dims_served(head_dim: int, head_dim_v: int) -> bool:
    """Head dims every FA4 architecture Poros runs it on takes (SM90 takes 8-256 in steps of 8, SM100 8-128, (192,
    128) and (256, 256): `_validate_head_dims`)."""
    small = all(8 <= d <= 128 and d % 8 == 0 for d in (head_dim, head_dim_v))
    return small or (head_dim, head_dim_v) in ((192, 128), (256, 256))


def serves(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> bool:
    """Whether an SDPA call (its arguments, SDPA's layout: batch, heads, seqlen, head_dim) runs on FA4."""
    if attn_mask is not None or dropout_p or any(t.dim() != 4 for t in (query, key, value)):
        return False
    if query.device.type != KERNEL.device or query.dtype not in DTYPES:
        return False
    if any(t.dtype != query.dtype or t.device != query.device for t in (key, value)):
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    if value.shape[1] != kv_heads or key.shape[-1] != query.shape[-1] or key.shape[2] != value.shape[2]:
        return False
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        return False
    if is_causal and query.shape[2] != key.shape[2]:
        return False
    return head_dims_served(query.shape[-1], value.shape[-1])


def attention(query, key, value, is_causal: bool, scale: float | None, deterministic: bool) -> torch.Tensor:
    """FA4's attention on SDPA's layout (batch, heads, seqlen, head_dim) in and out; `deterministic`: a backward
    that repeats bit for bit."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    out, _ = torch.ops.poros.fa4_forward(q, k, v, scale, is_causal, deterministic)
    return out.transpose(1, 2)


@torch.library.custom_op("poros::fa4_forward", mutates_args=())
def fa4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of FA4's forward, layout (batch, seqlen, heads, head_dim); `deterministic` is its backward's."""
    out, lse = KERNEL.forward(q, k, v, scale, causal)
    return out.contiguous(), lse.contiguous()


@fa4_forward.register_fake
def _forward_shapes(q, k, v, scale, causal, deterministic):
    batch, seq, heads, _ = q.shape
    return q.new_empty(batch, seq, heads, v.shape[-1]), q.new_empty(batch, heads, seq, dtype=torch.float32)


@torch.library.custom_op("poros::fa4_backward", mutates_args=())
def fa4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, scale: float, causal: bool,
                 deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of FA4's backward, each contiguous in its input's shape."""
    grads = KERNEL.backward(dout, q, k, v, out, lse, scale, causal, deterministic)
    return tuple(g.contiguous() for g in grads)


@fa4_backward.register_fake
def _backward_shapes(dout, q, k, v, out, lse, scale, causal, deterministic):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _save(ctx, inputs, output) -> None:
    q, k, v, scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # the output unused: no gradient flows
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.poros.fa4_backward(dout, q, k, v, out, lse, ctx.scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


fa4_forward.register_autograd(_gradients, setup_context=_save)
