"""Where each NF4 matrix of a model lives in the store's arena: byte offsets from shapes alone.

Layers are laid out back to back in model order, so a block of consecutive layers is one contiguous
byte range and moves host->device in a single copy. With double quantization (the `double_quant`
setting) each slot holds what bitsandbytes' `quantize_4bit(..., compress_statistics=True)` makes: the
packed weight, the absmax quantized to uint8, and the nested state (a float32 absmax per
NESTED_BLOCKSIZE absmax values, then the float32 offset subtracted before quantizing them). The
arena's tensors live in poros/store/arena.py; this module needs no torch, so the planner sizes
plans from it without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 256  # bytes; keeps every view aligned for vectorised kernel loads
NF4_BLOCKSIZE = 64  # bitsandbytes' QLoRA default (one float32 absmax per 64 weights)
NESTED_BLOCKSIZE = 256  # bitsandbytes' blocksize for quantizing the absmax again (compress_statistics)


def align(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_nbytes(numel: int, double_quant: bool) -> tuple[int, int, int]:
    """Bytes of one NF4 matrix of `numel` weights: (packed weight, absmax, nested absmax + offset)."""
    absmax = -(-numel // NF4_BLOCKSIZE)
    if not double_quant:
        return numel // 2, 4 * absmax, 0
    return numel // 2, absmax, 4 * (-(-absmax // NESTED_BLOCKSIZE) + 1)


@dataclass(frozen=True)
class QuantSlot:
    """Where one NF4 matrix lives inside the arena (byte offsets from the arena start)."""

    name: str  # module name, e.g. "model.layers.3.mlp.down_proj"
    shape: tuple[int, int]  # (out_features, in_features)
    weight_offset: int
    absmax_offset: int
    nested_offset: int | None = None  # double quantization: the nested absmax, then the offset

    @property
    def double_quant(self) -> bool:
        return self.nested_offset is not None

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def weight_nbytes(self) -> int:
        return slot_nbytes(self.numel, self.double_quant)[0]

    @property
    def absmax_numel(self) -> int:
        return -(-self.numel // NF4_BLOCKSIZE)

    @property
    def absmax_nbytes(self) -> int:
        return slot_nbytes(self.numel, self.double_quant)[1]

    @property
    def nested_numel(self) -> int:
        """float32 values of the nested absmax (double quantization only; the offset follows them)."""
        return slot_nbytes(self.numel, self.double_quant)[2] // 4 - 1


@dataclass(frozen=True)
class LayerLayout:
    index: int
    start: int  # byte range [start, end) of this layer in the arena
    end: int
    slots: tuple[QuantSlot, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_layout(layer_linears: list[list[tuple[str, tuple[int, int]]]],
                double_quant: bool = False) -> tuple[list[LayerLayout], int]:
    """Assign arena offsets to every quantized matrix, layer after layer.

    Args:
        layer_linears: for each decoder layer, its (module name, (out, in)) linears in order.
        double_quant: slots hold a uint8 absmax and its nested state instead of a float32 absmax.
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
            weight, absmax, nested = slot_nbytes(numel, double_quant)
            w_off = offset
            offset = align(offset + weight)
            a_off = offset
            offset = align(offset + absmax)
            n_off = offset if double_quant else None
            offset = align(offset + nested)
            slots.append(QuantSlot(name, (int(shape[0]), int(shape[1])), w_off, a_off, n_off))
        layouts.append(LayerLayout(index, start, offset, tuple(slots)))
    return layouts, offset
