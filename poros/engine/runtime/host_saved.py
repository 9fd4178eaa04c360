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

`host_limit` bounds the host bytes one forward's saved tensors take (as the allocator rounds them): the first
tensors a forward saves, the first layers' inputs, go to host memory while they fit, and the rest stay on the
device, the split poros's plan makes for its own saved inputs (poros/engine/planning/inputs.py). Where a tensor
lives changes no byte of it, so the arithmetic is the same whatever the limit.
"""

from __future__ import annotations

import contextlib

import torch


def _dense(t: torch.Tensor) -> bool:
    """Whether a copy made like `t` (torch's preserve_format) has `t`'s strides: its elements cover its memory
    densely, without overlap."""
    return torch.empty_like(t, device="meta").stride() == t.stride()


def host_block(nbytes: int, pin: bool) -> int:
    """Host bytes a saved tensor of `nbytes` takes: page-locked through torch's caching host allocator, the next
    power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if pin and nbytes else nbytes


def saved_host_limit(setting, store_bytes: int, cuda: bool, available: int | None) -> int | None:
    """The host bytes a reference's saved tensors may take (`host_limit`) under `host_budget: setting`, which
    holds the NF4 store (`store_bytes`, built and held already) and the saved tensors together, as it does for
    poros's plan (poros/engine/planning/inputs.py `host_budget`; `available`: what the host has left). None:
    unchecked (host_budget none, off CUDA, or auto where the host's memory is not known)."""
    from poros.engine.planning.inputs import HostMemory, host_budget

    host = None if available is None else HostMemory(available, held=store_bytes)
    budget = host_budget(setting, host, cuda)
    return None if budget is None else max(0, budget - store_bytes)


class HostSaved:
    """Autograd's saved tensors in host memory while `scope` is entered; `pin`: page-locked (CUDA); `host_limit`:
    the host bytes one scope's tensors may take (None: every one goes; module docstring)."""

    def __init__(self, pin: bool, host_limit: int | None = None):
        self.pin, self.host_limit = pin, host_limit
        self.bytes_d2h = self.bytes_h2d = self.bytes_kept = 0
        self.held = 0  # host bytes of this scope's saved tensors

    @contextlib.contextmanager
    def scope(self, model: torch.nn.Module):
        """Tensors autograd saves inside go to host memory, the tensors of `model`'s own weights excepted."""
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.held = 0
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, own), self.unpack):
            yield

    def pack(self, t: torch.Tensor, own: set):
        """`t` copied to host memory, with its device; `t` itself where it stays (a weight in `own`, a layout a
        copy would not keep, or past `host_limit`)."""
        if t.untyped_storage().data_ptr() in own or t.is_sparse or not _dense(t):
            return t
        nbytes = t.numel() * t.element_size()
        block = host_block(nbytes, self.pin)
        if self.host_limit is not None and self.held + block > self.host_limit:
            self.bytes_kept += nbytes
            return t
        self.held += block
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin)
        host.copy_(t)
        self.bytes_d2h += nbytes
        return t.device, host

    def unpack(self, packed) -> torch.Tensor:
        """What `pack` kept, on its device again."""
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.bytes_h2d += host.numel() * host.element_size()
        return host.to(device, non_blocking=self.pin, copy=True)

    def counters(self) -> dict:
        """The bytes that went to host memory and back, and those kept on the device past `host_limit`, since the
        last call."""
        out = {"saved_bytes_d2h": self.bytes_d2h, "saved_bytes_h2d": self.bytes_h2d,
               "saved_bytes_kept": self.bytes_kept}
        self.bytes_d2h = self.bytes_h2d = self.bytes_kept = 0
        return out
