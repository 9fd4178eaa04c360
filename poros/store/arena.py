"""The NF4 store: every decoder layer's packed weights and absmax in one exact-size host arena, laid
out as poros/store/layout.py places them, and the tensor views of its slots."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from poros.errors import PinningError
from poros.store.layout import LayerLayout, QuantSlot


def weight_view(buf: torch.Tensor, slot: QuantSlot, base: int = 0) -> torch.Tensor:
    """The packed NF4 bytes of `slot` as bitsandbytes stores them: uint8 of shape (numel/2, 1)."""
    o = slot.weight_offset - base
    return buf[o : o + slot.weight_nbytes].view(slot.weight_nbytes, 1)


def absmax_view(buf: torch.Tensor, slot: QuantSlot, base: int = 0) -> torch.Tensor:
    """The absmax of `slot`: float32, or with double quantization its uint8 codes."""
    o = slot.absmax_offset - base
    view = buf[o : o + slot.absmax_nbytes]
    return view if slot.double_quant else view.view(torch.float32)


class SlotTensors(NamedTuple):
    """One NF4 matrix's tensors as bitsandbytes' QuantState holds them."""

    weight: torch.Tensor  # packed NF4, uint8 (numel/2, 1)
    absmax: torch.Tensor  # float32, or uint8 with double quantization
    nested_absmax: torch.Tensor | None = None  # double quantization: float32, one per NESTED_BLOCKSIZE absmax
    offset: torch.Tensor | None = None  # double quantization: float32 scalar added back to the absmax

    def to(self, device) -> "SlotTensors":
        """Each tensor copied to `device` as its own tensor (what a resident model holds)."""
        return SlotTensors(*(None if t is None else t.to(device, copy=True) for t in self))


def slot_tensors(buf: torch.Tensor, slot: QuantSlot, base: int = 0) -> SlotTensors:
    """Views of `slot`'s tensors in `buf`, a copy of the arena from byte `base` on."""
    weight, absmax = weight_view(buf, slot, base), absmax_view(buf, slot, base)
    if not slot.double_quant:
        return SlotTensors(weight, absmax)
    o = slot.nested_offset - base
    nested = buf[o : o + 4 * (slot.nested_numel + 1)].view(torch.float32)
    return SlotTensors(weight, absmax, nested[:-1], nested[-1])


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
    # the lookup table of the nested absmax (bitsandbytes' dynamic map) when the slots are double-quantized
    nested_code: torch.Tensor | None = None
    pinned: bool = False
    _registered: bool = field(default=False, repr=False)
    _pinned_dense: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if {slot.double_quant for slot in self.slots()} - {self.nested_code is not None}:
            raise ValueError("NF4Store: the nested lookup table is given exactly when every slot is double-quantized")

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    @property
    def host_bytes(self) -> int:
        """Host memory the store holds: the arena, the dense weights and the layers' buffers."""
        rest = (*self.dense.values(), *self.buffers.values())
        return self.nbytes + sum(t.numel() * t.element_size() for t in rest)

    @property
    def double_quant(self) -> bool:
        return self.nested_code is not None

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

    def release(self) -> None:
        """Give the store's host memory back (unpinned, its tensors dropped) while the object may still be
        referenced: nothing can read it afterwards (`released`), and whatever needs the weights builds them again."""
        self.unpin()
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.dense, self.buffers = {}, {}

    @property
    def released(self) -> bool:
        """Whether `release` gave the store's host memory back (a built store's arena is never empty)."""
        return self.arena.numel() == 0

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
    "NF4Store",
    "SlotTensors",
    "absmax_view",
    "host_buffer",
    "slot_tensors",
    "weight_view",
]
