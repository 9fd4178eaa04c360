"""Which SDPA backend attention runs on: the same for every method (they make the same calls), and a
record of what torch chose for each attention shape.

`fast` lists flash, then memory-efficient, then math, in that priority: each call gets flash where its
shape allows (causal or no mask, head dim up to 256), memory-efficient where it does not (a mask, e.g.
sliding-window layers; other head dims), math only where neither serves (e.g. gemma4's 512-dim
full-attention layers under flash). The choice depends on shapes, dtypes and the mask alone, so resident
QLoRA and poros make it identically; under `deterministic` flash and memory-efficient run their
deterministic backward (cuDNN is never in the list).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from poros.settings import Attention


def _backends(attention: Attention):
    from torch.nn.attention import SDPBackend

    return {
        Attention.MATH: [SDPBackend.MATH],
        Attention.CUDNN: [SDPBackend.CUDNN_ATTENTION],
        Attention.EFFICIENT: [SDPBackend.EFFICIENT_ATTENTION],
        Attention.FLASH: [SDPBackend.FLASH_ATTENTION],
        Attention.FAST: [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }[attention]


def sdpa_context(attention: Attention):
    """Pin the SDPA backend(s) for both methods alike (`default`: torch's own choice)."""
    if attention is Attention.DEFAULT:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_backends(attention), set_priority=attention is Attention.FAST)


def _name(choice: int) -> str:
    from torch.nn.attention import SDPBackend

    names = {int(v): n.lower() for n, v in SDPBackend.__members__.items()}
    return names.get(int(choice), str(choice)).replace("_attention", "")


def shape_label(query: torch.Tensor, key: torch.Tensor, attn_mask, is_causal: bool) -> str:
    """An attention call's shape as rows record it, e.g. `head_dim 128, heads 64/8, causal`."""
    kind = "mask" if attn_mask is not None else ("causal" if is_causal else "unmasked")
    return f"head_dim {query.shape[-1]}, heads {query.shape[-3]}/{key.shape[-3]}, {kind}"


class BackendLog:
    """While active, records the backend torch picks for each distinct attention shape (under whatever
    `sdpa_context` is active at the call): {shape_label: "flash" | "efficient" | "math" | ...}."""

    def __init__(self):
        self.seen: dict[str, str] = {}
        self._real = None

    def __enter__(self) -> "BackendLog":
        self._real = real = F.scaled_dot_product_attention

        def recorded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            label = shape_label(query, key, attn_mask, is_causal)
            if label not in self.seen:  # SDPA makes this same query itself, on every call (during a capture too)
                try:
                    choice = torch._fused_sdp_choice(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                     is_causal=is_causal, scale=scale,
                                                     enable_gqa=kw.get("enable_gqa", False))
                    self.seen[label] = _name(choice)
                except RuntimeError:
                    self.seen[label] = "none available"
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

        F.scaled_dot_product_attention = recorded
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._real
