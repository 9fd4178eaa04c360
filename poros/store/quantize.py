"""NF4 quantization of one bf16 weight as bitsandbytes does it, and its quant state as a store slot holds it:
the absmax in float32, or with double quantization (`compress_statistics`) quantized again."""

from __future__ import annotations

import torch

from poros.store.arena import SlotTensors, slot_tensors
from poros.store.layout import NESTED_BLOCKSIZE, NF4_BLOCKSIZE, QuantSlot


def quantize_nf4(w: torch.Tensor, double_quant: bool = False):
    """bitsandbytes' `quantize_4bit` of `w` (NF4, blocksize 64): the packed bytes and the QuantState."""
    import bitsandbytes.functional as bnbf  # optional dependency: only a build or a binding needs it

    return bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=double_quant, quant_type="nf4")


def nest(state):
    """A plain NF4 QuantState with its float32 absmax quantized again, as `quantize_4bit(...,
    compress_statistics=True)` does it (the offset is the absmax's mean), so a plain checkpoint read with
    double quantization holds the bytes a double-quantized build of the same weights holds."""
    import bitsandbytes.functional as bnbf

    offset = state.absmax.mean()
    qabsmax, state2 = bnbf.quantize_blockwise(state.absmax - offset, blocksize=NESTED_BLOCKSIZE)
    return bnbf.QuantState(absmax=qabsmax, shape=state.shape, dtype=state.dtype, blocksize=state.blocksize,
                           code=state.code, quant_type=state.quant_type, offset=offset, state2=state2)


def expand(state):
    """A double-quantized QuantState with its absmax dequantized to float32, exactly as bitsandbytes'
    `dequantize_4bit` expands it before every use (so the plain state dequantizes to the same weights)."""
    import bitsandbytes.functional as bnbf

    absmax = bnbf.dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return bnbf.QuantState(absmax=absmax.float(), shape=state.shape, dtype=state.dtype, blocksize=state.blocksize,
                           code=state.code, quant_type=state.quant_type)


def as_stored(state, double_quant: bool):
    """`state` in the form a store of `double_quant` holds: nested where it is not, expanded where it is."""
    if state.nested == double_quant:
        return state
    return nest(state) if double_quant else expand(state)


def write_slot(arena: torch.Tensor, slot: QuantSlot, packed: torch.Tensor, state) -> None:
    """The packed bytes and the QuantState (in the slot's form: `as_stored`) into the slot's arena bytes."""
    if state.nested != slot.double_quant:
        raise ValueError(f"{slot.name}: a {'nested' if state.nested else 'plain'} quant state for a "
                         f"{'double-quantized' if slot.double_quant else 'plain'} slot")
    t = slot_tensors(arena, slot)
    t.weight.copy_(packed.reshape(-1, 1))
    if not slot.double_quant:
        t.absmax.copy_(state.absmax.float())
        return
    if state.state2.blocksize != NESTED_BLOCKSIZE or state.state2.absmax.dtype != torch.float32:
        raise ValueError(f"{slot.name}: nested absmax of blocksize {state.state2.blocksize} "
                         f"({state.state2.absmax.dtype}); the store holds blocksize {NESTED_BLOCKSIZE} float32")
    t.absmax.copy_(state.absmax)
    t.nested_absmax.copy_(state.state2.absmax)
    t.offset.copy_(state.offset)


def quant_state(t: SlotTensors, code: torch.Tensor, nested_code: torch.Tensor | None, shape):
    """The bitsandbytes QuantState over one slot's tensors, as bitsandbytes builds it for an NF4 bf16 linear
    (with double quantization: the nested state `state2` and the offset)."""
    from bitsandbytes.functional import QuantState

    state2 = None
    if t.nested_absmax is not None:
        state2 = QuantState(absmax=t.nested_absmax, code=nested_code, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
    return QuantState(absmax=t.absmax, shape=torch.Size(shape), code=code, blocksize=NF4_BLOCKSIZE,
                      quant_type="nf4", dtype=torch.bfloat16, offset=t.offset, state2=state2)


class Codes:
    """The lookup tables every slot of a store shares (NF4's, and with double quantization the nested
    absmax's), taken from the first slot's quant state."""

    def __init__(self):
        self.code: torch.Tensor | None = None
        self.nested: torch.Tensor | None = None

    def take(self, state) -> bool:
        """Record `state`'s tables if none are yet; False if they differ from those recorded."""
        code = state.code.to("cpu")
        nested = state.state2.code.to("cpu") if state.nested else None
        if self.code is None:
            self.code, self.nested = code, nested
            return True
        return torch.equal(code, self.code) and (
            nested is None if self.nested is None else nested is not None and torch.equal(nested, self.nested))
