"""Read an already NF4-quantized bitsandbytes checkpoint straight into an NF4 store.

A folder whose config.json carries a bitsandbytes 4-bit `quantization_config` (what transformers'
`save_pretrained` writes for a `load_in_4bit` model, and what poros/store/export.py writes) holds each
quantized linear as packed uint8 bytes plus its quant state (`.absmax`, `.quant_map`, and with
double quantization `.nested_absmax`, `.nested_quant_map`). The bytes are copied into the arena as
they are where the store's form (the `double_quant` setting) is the checkpoint's; otherwise a
double-quantized absmax is expanded to float32 exactly as bitsandbytes does before every
dequantization (the store dequantizes to the checkpoint's weights bit for bit), and a plain one is
quantized again as bitsandbytes' `compress_statistics` does. Linears the checkpoint left unquantized
are quantized here, as a bf16 build would.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from poros.errors import CheckpointError
from poros.models.checkpoint import CheckpointReader
from poros.models.skeleton import persistent_buffers
from poros.store.layout import NF4_BLOCKSIZE
from poros.store.quantize import Codes, as_stored, quantize_nf4, write_slot

QUANT_STATE_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4",
                    "quant_state.bitsandbytes__fp4")


def quantization_config(path: Path) -> dict | None:
    """The `quantization_config` of a checkpoint folder's config.json, if it has one."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    return q if isinstance(q, dict) else None


def is_bnb_checkpoint(path: Path) -> bool:
    q = quantization_config(path)
    return q is not None and q.get("quant_method") == "bitsandbytes"


def _check_config(path: Path, q: dict) -> None:
    if q.get("load_in_8bit") or q.get("_load_in_8bit"):
        raise CheckpointError(f"{path}: an 8-bit bitsandbytes checkpoint; poros trains on NF4 (4-bit) weights: "
                              "use the bf16/fp16 checkpoint or an NF4 one")
    kind = q.get("bnb_4bit_quant_type", "fp4")
    if kind != "nf4":
        raise CheckpointError(f"{path}: bnb_4bit_quant_type is {kind!r}, expected 'nf4'; "
                              "use the bf16/fp16 checkpoint and let poros quantize it")


def _quant_state(reader, name: str, path: Path):
    """The bitsandbytes QuantState stored next to the packed weight `name`."""
    from bitsandbytes.functional import QuantState

    parts = {k: reader.get(f"{name}.{k}") for k in QUANT_STATE_KEYS if reader.has(f"{name}.{k}")}
    if "absmax" not in parts:
        raise CheckpointError(f"{path}: {name} is packed (uint8) but has no {name}.absmax quant state")
    try:
        state = QuantState.from_dict(parts, device=torch.device("cpu"))
    except (ValueError, KeyError, AssertionError) as e:
        raise CheckpointError(f"{path}: {name}: unreadable quant state ({e})") from None
    if state.quant_type != "nf4" or state.blocksize != NF4_BLOCKSIZE:
        raise CheckpointError(f"{path}: {name} is {state.quant_type} with blocksize {state.blocksize}; poros holds "
                              f"nf4 with blocksize {NF4_BLOCKSIZE}: use the bf16/fp16 checkpoint")
    return state


class NF4CheckpointLayers:
    """The layers of a bitsandbytes 4-bit checkpoint folder `src` (a poros.models.checkpoint.Source), for the
    build loop (poros/store/build.py `build_from`): packed bytes and quant state copied into the arena as they
    are (the absmax expanded or quantized again where `double_quant` asks for the other form), linears the
    checkpoint left unquantized quantized on `device`.

    Raises:
        CheckpointError: 8-bit or fp4 quantization, another blocksize, a missing tensor or quant state,
            or shapes that do not match the config.
    """

    what = "loading"

    def __init__(self, src, device: torch.device, double_quant: bool = False):
        self.path = Path(src.checkpoint)
        _check_config(self.path, quantization_config(self.path))
        self.config = copy.deepcopy(src.config)
        if hasattr(self.config, "quantization_config"):  # the store is plain NF4 data; no model is quantized again
            del self.config.quantization_config
        self.reader = CheckpointReader(self.path)
        self.device, self.double_quant = device, double_quant
        self.codes = Codes()

    def host_need(self, model, layers, arena_bytes):
        return None

    def fill_layer(self, model, layer, index, prefix, layout, arena, dense, buffers):
        path, reader = self.path, self.reader
        linear_weights = {f"{n}.weight" for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        for slot in layout.slots:
            w = reader.get(f"{slot.name}.weight")
            if w.is_floating_point():  # left unquantized by the checkpoint: quantize as a build does
                packed, state = quantize_nf4(w.to(device=self.device, dtype=torch.bfloat16), self.double_quant)
            else:
                state = _quant_state(reader, f"{slot.name}.weight", path)
                if tuple(state.shape) != slot.shape:
                    raise CheckpointError(f"{path}: {slot.name}.weight has shape {tuple(state.shape)}, the config "
                                          f"gives {slot.shape}")
                packed = w.view(torch.uint8)
                if self.double_quant and not state.nested:  # quantized again where a build quantizes: the
                    state.to(self.device)  # offset is a mean, its last bits the device's
                state = as_stored(state, self.double_quant)
            if packed.numel() != slot.weight_nbytes or state.absmax.numel() != slot.absmax_numel:
                raise CheckpointError(f"{path}: {slot.name}.weight holds {packed.numel()} bytes and "
                                      f"{state.absmax.numel()} absmax values, expected {slot.weight_nbytes} and "
                                      f"{slot.absmax_numel}")
            if not self.codes.take(state):
                raise CheckpointError(f"{path}: {slot.name}.weight uses other lookup tables than the layers "
                                      "before it")
            try:
                write_slot(arena, slot, packed, state)
            except ValueError as e:
                raise CheckpointError(f"{path}: {e}") from None
        for name, p in layer.named_parameters():
            if name not in linear_weights:
                dense[f"{prefix}.{name}"] = reader.get(f"{prefix}.{name}").to(p.dtype).clone()
        for name, b in persistent_buffers(layer):
            full = f"{prefix}.{name}"
            buffers[full] = (reader.get(full) if reader.has(full) else b).to("cpu", b.dtype, copy=True)

    def fill_rest(self, model, layers, dense):
        in_layers = {id(p) for p in layers.parameters()}
        tied = getattr(self.config, "tie_word_embeddings", False)
        for mname, module in model.named_modules():
            for n, p in module.named_parameters(recurse=False):
                full = f"{mname}.{n}" if mname else n
                if id(p) in in_layers or (tied and full == "lm_head.weight") or full in dense:
                    continue
                t = self.reader.get(full)
                if not t.is_floating_point():
                    raise CheckpointError(f"{self.path}: {full} is quantized; poros quantizes only the decoder "
                                          "layers' linears (keep lm_head and embeddings in bf16: "
                                          "llm_int8_skip_modules)")
                dense[full] = t.to(p.dtype).clone()
