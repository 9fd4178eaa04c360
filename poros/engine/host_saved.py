"""Tensors autograd saves, kept in host memory (`HostSaved`), what torch.autograd.graph.save_on_cpu does, with
the bytes counted each way and the model's own weights left where they are.

Around resident_gc's forward this moves every checkpointed layer's input: non-reentrant checkpointing saves a
layer's positional inputs with autograd's saved-tensor hooks before it enters its own (the outer ones, these),
and what the layer saves inside is the checkpoint's own business (recomputed in backward); beside them, what the
head saves outside any layer (the final norm's and the lm_head's inputs). A tensor comes back to its device
with the same bytes, so the arithmetic is resident_gc's, bit for bit.

Page-locked on CUDA, through torch's caching host allocator (each block rounded up to a power of two, reused
step after step); a tensor whose layout a copy would not keep (overlapping or with holes: an expanded mask) stays
where it is, as does a parameter or buffer of the model (the frozen lm_head's weight, which the head saves).
"""

from __future__ import annotations

import contextlib

import torch


def _dense(t: torch.Tensor) -> bool:
    """Whether a copy made like `t` (torch's preserve_format) has `t`'s strides: its elements cover its memory
    densely, without overlap."""
    return torch.empty_like(t, device="meta").stride() == t.stride()


class HostSaved:
    """Autograd's saved tensors in host memory while `scope` is entered; `pin`: page-locked (CUDA)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.bytes_d2h = self.bytes_h2d = 0

    @contextlib.contextmanager
    def scope(self, model: torch.nn.Module):
        """Tensors autograd saves inside go to host memory, the tensors of `model`'s own weights excepted."""
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, own), self.unpack):
            yield

    def pack(self, t: torch.Tensor, own: set):
        """`t` copied to host memory, with its device; `t` itself where it stays (a weight in `own`, a layout a
        copy would not keep)."""
        if t.untyped_storage().data_ptr() in own or t.is_sparse or not _dense(t):
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
        host.copy_(t)
        self.bytes_d2h += t.numel() * t.element_size()
        return t.device, host

    def unpack(self, packed) -> torch.Tensor:
        """What `pack` kept, on its device again."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.bytes_h2d += host.numel() * host.element_size()
        return host.to(device, non_blocking=self.pin, copy=True)

    def counters(self) -> dict:
        """The bytes that went to host memory and back since the last call."""
        out = {"saved_bytes_d2h": self.bytes_d2h, "saved_bytes_h2d": self.bytes_h2d}
        self.bytes_d2h = self.bytes_h2d = 0
        return out
