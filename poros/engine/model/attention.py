"""Which SDPA backend attention runs on: the same for every method (they make the same calls), and a
record of what torch chose for each attention shape.

`fast` lists flash, then memory-efficient, then math, in that priority: each call gets flash where its
shape allows (causal or no mask, head dim up to 256), memory-efficient where it does not (a mask, e.g.
sliding-window layers; gemma4's 512-dim full-attention layers), math only where neither serves (e.g. a
mask with `enable_gqa`: memory-efficient needs as many key/value heads as query heads). The choice
depends on shapes, dtypes and the mask alone, so resident QLoRA and poros make it identically; under
`deterministic` flash and memory-efficient run their deterministic backward (cuDNN is never in the list).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from poros.choices import Attention
from poros.errors import CapabilityError


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


def _choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, label) -> str:
    """The backend torch picks for this call under the active backend list, or a CapabilityError naming the
    shape and torch's reasons when no backend of the list serves it (instead of SDPA's bare "No available
    kernel"). E.g. memory-efficient takes a mask but needs as many key/value heads as query heads: with
    `enable_gqa` and a mask only math serves (transformers repeats the key/value heads itself when it
    passes a mask, so sliding-window layers reach memory-efficient at any length)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _name(torch._fused_sdp_choice(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa))
        except RuntimeError as e:
            reasons = [str(w.message).strip() for w in caught if "Triggered internally" not in str(w.message)]
            raise CapabilityError(
                f"no attention kernel of the chosen setting serves {label}"
                f"{' with enable_gqa' if enable_gqa else ''}: {'; '.join(reasons) or str(e).strip()}. "
                "`--attention fast` falls back to math where flash and memory-efficient cannot serve") from None


class BackendLog:
    """While active, records the backend torch picks for each distinct attention shape (under whatever
    `sdpa_context` is active at the call): {shape_label: "flash" | "efficient" | "math" | ...}; a shape no
    backend of the list serves is a CapabilityError."""

    def __init__(self):
        self.seen: dict[str, str] = {}
        self._real = None

    def __enter__(self) -> "BackendLog":
        self._real = real = F.scaled_dot_product_attention

        def recorded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            label = shape_label(query, key, attn_mask, is_causal)
            if label not in self.seen:  # SDPA makes this same query itself, on every call (during a capture too)
                self.seen[label] = _choose(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                           kw.get("enable_gqa", False), label)
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

        F.scaled_dot_product_attention = recorded
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._real
