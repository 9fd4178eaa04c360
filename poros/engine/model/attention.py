"""Which SDPA backend attention runs on: the same for every method (they make the same calls), and a
record of what torch chose for each attention shape.

`fast` lists flash, then memory-efficient, then math, in that priority: each call gets flash where its
shape allows (causal or no mask, head dim up to 256), memory-efficient where it does not (a mask, e.g.
sliding-window layers; gemma4's 512-dim full-attention layers), math only where neither serves (e.g. a
mask with `enable_gqa`: memory-efficient needs as many key/value heads as query heads). The choice
depends on shapes, dtypes and the mask alone, so resident QLoRA and poros make it identically; under
`deterministic` flash and memory-efficient run their deterministic backward (cuDNN is never in the list).

`fa4` routes every call FlashAttention-4's kernels serve (poros/engine/model/fa4.py `serves`: causal or unmasked,
bf16/fp16 on CUDA, no dropout, head dims its kernels take) to them, with their deterministic backward under
`deterministic`, and runs every other call on the `fast` list. The routing replaces
F.scaled_dot_product_attention while `sdpa_context` is entered, as transformers' SDPA attention calls it, so both
methods route the same calls alike, eagerly, in torch.compile'd layers (FA4's calls are custom ops there) and in
CUDA-graph templates; Unsloth's child keeps its own attention (`routed=False`).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from poros.choices import ATTENTION_NEEDS, Attention
from poros.engine.model import fa4
from poros.errors import CapabilityError


def _backends(attention: Attention):
    """SDPA's backend list of `attention`: a value that routes calls elsewhere (`fa4`) runs the others on the list of
    the value its needs name instead (`fast`)."""
    from torch.nn.attention import SDPBackend

    if attention in ATTENTION_NEEDS:
        attention = ATTENTION_NEEDS[attention].instead
    return {
        Attention.MATH: [SDPBackend.MATH],
        Attention.CUDNN: [SDPBackend.CUDNN_ATTENTION],
        Attention.EFFICIENT: [SDPBackend.EFFICIENT_ATTENTION],
        Attention.FLASH: [SDPBackend.FLASH_ATTENTION],
        Attention.FAST: [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }[attention]


def sdpa_context(attention: Attention, routed: bool = True):
    """Pin the SDPA backend(s) for both methods alike (`default`: torch's own choice); with `fa4` also route the calls
    FA4 serves to it (`routed`; False: the `fast` list alone, as Unsloth's child runs its own attention)."""
    if attention is Attention.DEFAULT:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    pinned = sdpa_kernel(_backends(attention), set_priority=len(_backends(attention)) > 1)
    if attention is not Attention.FA4 or not routed:
        return pinned
    stack = contextlib.ExitStack()
    stack.enter_context(pinned)
    stack.enter_context(_Routing())
    return stack


# What `dispatched_sdpa` reads (module globals: a compiled layer's guards check them, plain booleans that stay
# the same from call to call) and how many holders want it in F.scaled_dot_product_attention's place.
_routing = False  # calls FA4 serves go to it
_logs: list["BackendLog"] = []  # every BackendLog entered notes each call's backend
_route_depth = 0
_holders = 0
_replaced = None  # F.scaled_dot_product_attention before the first holder replaced it


def dispatched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """F.scaled_dot_product_attention while routing or logging: FA4 where routing is on and it serves the call,
    else SDPA under the pinned backend list; each BackendLog entered notes the backend."""
    to_fa4 = _routing and fa4.serves(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    for log in _logs:
        log.note(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, to_fa4)
    if to_fa4:
        return fa4.attention(query, key, value, is_causal, scale, torch.are_deterministic_algorithms_enabled())
    return _replaced(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)


def _hold() -> None:
    global _holders, _replaced
    if _holders == 0:
        _replaced, F.scaled_dot_product_attention = F.scaled_dot_product_attention, dispatched_sdpa
    _holders += 1


def _release() -> None:
    global _holders, _replaced
    _holders -= 1
    if _holders == 0:
        F.scaled_dot_product_attention, _replaced = _replaced, None


class _Routing:
    """While entered (by any number of holders at once), calls FA4 serves run on it."""

    def __enter__(self) -> "_Routing":
        global _route_depth, _routing
        _hold()
        _route_depth += 1
        _routing = True
        return self

    def __exit__(self, *exc) -> None:
        global _route_depth, _routing
        _route_depth -= 1
        _routing = _route_depth > 0
        _release()


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
    """While active, records the backend each distinct attention shape runs on (under whatever `sdpa_context` is
    active at the call): {shape_label: "flash" | "efficient" | "math" | "fa4" | ...}; a shape no backend of the list
    serves is a CapabilityError."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    def __enter__(self) -> "BackendLog":
        _hold()
        _logs.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _logs.remove(self)
        _release()

    def note(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, to_fa4: bool) -> None:
        """Record the call's backend: `fa4` where it is routed there, else SDPA's choice (a shape seen once is not
        asked again: SDPA makes this same query itself, on every call, during a capture too)."""
        label = shape_label(query, key, attn_mask, is_causal)
        if label not in self.seen:
            self.seen[label] = "fa4" if to_fa4 else _choose(query, key, value, attn_mask, dropout_p, is_causal,
                                                             scale, enable_gqa, label)
