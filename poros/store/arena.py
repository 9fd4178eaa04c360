"""The NF4 store: every decoder layer's packed weights and absmax in one exact-size host arena.

Layers are laid out back to back in model order, so a block of consecutive layers is one
contiguous byte range and moves host->device in a single copy.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import torch

from poros.errors import PinningError

ALIGN = 256  # bytes; keeps every view aligned for vectorised kernel loads
NF4_BLOCKSIZE = 64  # bitsandbytes' QLoRA default (one float32 absmax per 64 weights)


def align(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class QuantSlot:
    """Where one NF4 matrix lives inside the arena (byte offsets from the arena start)."""

    name: str  # module name, e.g. "model.layers.3.mlp.down_proj"
    shape: tuple[int, int]  # (out_features, in_features)
    weight_offset: int
    absmax_offset: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def weight_nbytes(self) -> int:
        return self.numel // 2

    @property
    def absmax_numel(self) -> int:
        return -(-self.numel // NF4_BLOCKSIZE)


@dataclass(frozen=True)
class LayerLayout:
    index: int
    start: int  # byte range [start, end) of this layer in the arena
    end: int
    slots: tuple[QuantSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_layout(layer_linears: list[list[tuple[str, tuple[int, int]]]]) -> tuple[list[LayerLayout], int]:
    """Assign arena offsets to every quantized matrix, layer after layer.

    Args:
        layer_linears: for each decoder layer, its (module name, (out, in)) linears in order.
    Returns:
        The per-layer layouts and the arena size in bytes.
    """
    layouts, offset = [], 0
    for index, linears in enumerate(layer_linears):
        start, slots = offset, []
        for name, shape in linears:
            numel = shape[0] * shape[1]
            if numel % 2:
                raise ValueError(f"{name}: NF4 needs an even element count, got shape {shape}")
            w_off = offset
            offset = align(offset + numel // 2)
            a_off = offset
            offset = align(offset + 4 * -(-numel // NF4_BLOCKSIZE))
            slots.append(QuantSlot(name, (int(shape[0]), int(shape[1])), w_off, a_off))
        layouts.append(LayerLayout(index, start, offset, tuple(slots)))
    return layouts, offset


def weight_view(buf: torch.Tensor, slot: QuantSlot, base: int = 0) -> torch.Tensor:
    """The packed NF4 bytes of `slot` as bitsandbytes stores them: uint8 of shape (numel/2, 1)."""
    o = slot.weight_offset - base
    return buf[o : o + slot.weight_nbytes].view(slot.weight_nbytes, 1)


def absmax_view(buf: torch.Tensor, slot: QuantSlot, base: int = 0) -> torch.Tensor:
    o = slot.absmax_offset - base
    return buf[o : o + 4 * slot.absmax_numel].view(torch.float32)


def memlock_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MB"


@dataclass
class NF4Store:
    """NF4 decoder weights (arena) plus every other weight in bf16 (`dense`), all on the host.

    `dense` maps full parameter names (as in the model's state dict) to tensors; `code` is the
    NF4 lookup table bitsandbytes dequantizes with.
    """

    config: object
    layers: list[LayerLayout]
    arena: torch.Tensor
    dense: dict[str, torch.Tensor]
    code: torch.Tensor
    source: str
    # persistent buffers of the decoder layers (e.g. gemma4's layer_scalar), as built or as the
    # checkpoint has them; small, applied over the model skeleton's constructed values
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    pinned: bool = False
    _registered: bool = field(default=False, repr=False)
    _pinned_dense: list = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def slots(self):
        for layer in self.layers:
            yield from layer.slots

    def pin(self) -> None:
        """Page-lock the arena in place (exact size, unlike the caching host allocator).

        Raises:
            PinningError: naming the locked-memory limit and how to run unpinned.
        """
        if self.pinned:
            return
        size = self.arena.numel()
        if not pin_in_place(self.arena):
            raise PinningError(
                f"pinning {size / 1e9:.1f} GB failed (cudaHostRegister): the locked-memory "
                f"limit is {memlock_limit()} (ulimit -l); raise it or pass --no-pin (pageable copies run "
                f"several times slower)"
            )
        self.pinned = self._registered = True

    def pin_dense(self, name: str) -> bool:
        """Page-lock one dense tensor (e.g. lm_head, streamed each step); False if refused."""
        t = self.dense[name]
        if any(t is p for p in self._pinned_dense):
            return True
        if pin_in_place(t):
            self._pinned_dense.append(t)
            return True
        return False

    def unpin(self) -> None:
        while self._pinned_dense:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_dense.pop().data_ptr())
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self._registered = self.pinned = False

    def __del__(self):  # an arena must not be freed while still registered with the driver
        try:
            self.unpin()
        except Exception:
            pass


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock an existing host tensor at its exact size; False if the driver refused."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return int(getattr(err, "value", err)) == 0


def host_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed host byte buffer of exactly `nbytes` (no allocator rounding); zeroed so the
    alignment padding is deterministic and identical builds are identical bytes."""
    return torch.zeros(nbytes, dtype=torch.uint8)


__all__ = [
    "ALIGN",
    "align",
    "NF4_BLOCKSIZE",
    "LayerLayout",
    "NF4Store",
    "QuantSlot",
    "absmax_view",
    "host_buffer",
    "plan_layout",
    "weight_view",
]
