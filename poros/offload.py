"""Activation offload: keep a layer's forward graph, with its saved tensors in host memory.

Poros's backward recomputes each layer's forward. Where the backward is compute-bound and the
forward copy-bound (seq 512 on the H200: weights stream slower than a no-grad forward computes,
and a layer's backward outlasts its weight copy), some layers can instead run their forward with
autograd during the forward pass, their saved tensors copied device->host over the idle
direction of the PCIe link, and brought back host->device ahead of their backward: those layers
skip the recompute. The arithmetic is unchanged (the same modules and kernels run once, in grad
mode, as in resident training), and saved tensors come back bit for bit, with the same storage
offset, sizes and strides, so backward kernels see the very layout they would have seen.

Packing works per storage: views sharing a storage are copied once. Never offloaded: storages
below `min_bytes`, and protected ones (LoRA parameters, the NF4 block buffers, the layer's input
leaf), which stay referenced as they are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

MIN_BYTES = 64 << 10  # smaller storages (rotary tables, masks) stay on the device


@dataclass(frozen=True)
class _Ref:
    """What autograd holds instead of a saved tensor: a view description into a packed storage."""

    entry: _Storage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Storage:
    host: torch.Tensor  # uint8, the whole storage's bytes (pinned on CUDA)
    # the original storage, held until the layer's forward ends: while it lives its address cannot be
    # reused, so keying the table by address cannot confuse a freed storage with a new one
    source: torch.Tensor | None = None
    device: torch.Tensor | None = None  # uint8 on the device once fetched
    ready: object = None  # CUDA event recorded after the host->device copy


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def offloaded_layers(n_layers: int, last_block_first: int, fraction: float) -> frozenset[int]:
    """Layers whose activations go to the host: a share `fraction` of the layers, evenly spread,
    never in the last block (its backward follows its forward at once)."""
    if fraction <= 0:
        return frozenset()
    return frozenset(i for i in range(min(n_layers, last_block_first))
                     if int((i + 1) * fraction) > int(i * fraction))


class ActivationOffloader:
    """Saved-tensor hooks per layer, with device->host copies on their own stream and
    host->device prefetches on the caller's copy stream."""

    def __init__(self, device: torch.device, copy_stream=None, min_bytes: int | None = None):
        self.device, self.copy_stream = device, copy_stream
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        self.layers: dict[int, dict[int, _Storage]] = {}
        self.protected: set[int] = set()
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_d2h = self.bytes_h2d = 0

    # --- forward ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self, layer: int, protect: tuple[torch.Tensor, ...] = ()):
        """Context for running layer `layer`'s forward with autograd, its saved tensors packed."""
        table = self.layers.setdefault(layer, {})
        keep = self.protected | {t.untyped_storage().data_ptr() for t in protect}

        def pack(t: torch.Tensor):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in keep or st.nbytes() < self.min_bytes or t.device.type != self.device.type or t.is_sparse:
                return t
            entry = table.get(ptr)
            if entry is None:
                src = _bytes_of(st, t.device)
                entry = table[ptr] = _Storage(self._to_host(src), source=src)
            return _Ref(entry, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())

        def unpack(ref):
            if not isinstance(ref, _Ref):
                return ref
            entry = ref.entry
            if entry.device is None:  # not prefetched: fetch now, on the current stream
                if self.cuda:
                    torch.cuda.current_stream(self.device).wait_stream(self.d2h)  # after it reached the host
                entry.device = entry.host.to(self.device, non_blocking=self.cuda)
            out = torch.empty(0, dtype=ref.dtype, device=self.device)
            out.set_(entry.device.untyped_storage(), ref.offset, ref.size, ref.stride)
            return out

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        for entry in table.values():
            entry.source = None

    def _to_host(self, src: torch.Tensor) -> torch.Tensor:
        self.bytes_d2h += src.numel()
        if not self.cuda:
            return src.clone()
        host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(src, non_blocking=True)
        src.record_stream(self.d2h)  # the allocator may not reuse the memory before the copy ends
        return host

    # --- backward -----------------------------------------------------------------------------
    def prefetch(self, layer: int) -> None:
        """Start copying layer `layer`'s saved tensors back to the device (on the copy stream)."""
        for entry in self.layers.get(layer, {}).values():
            if entry.device is not None:
                continue
            self.bytes_h2d += entry.host.numel()
            if not self.cuda:
                entry.device = entry.host.clone()
                continue
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_stream(self.d2h)  # its device->host copy must be done
                entry.device = torch.empty_like(entry.host, device=self.device)
                entry.device.copy_(entry.host, non_blocking=True)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.copy_stream)

    def acquire(self, layer: int) -> None:
        """Make the compute stream wait for layer `layer`'s prefetched tensors."""
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for entry in self.layers.get(layer, {}).values():
            if entry.ready is not None:
                stream.wait_event(entry.ready)
            if entry.device is not None:
                entry.device.record_stream(stream)  # allocated on the copy stream, used here

    def release(self, layer: int) -> None:
        """Layer `layer`'s backward is enqueued: drop its packed tensors."""
        self.layers.pop(layer, None)

    def clear(self) -> None:
        self.layers.clear()
