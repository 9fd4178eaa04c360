"""Build the NF4 store layer by layer, one loop for every source: synthetic (seeded random init), a
bf16/fp16 checkpoint, or an NF4 checkpoint (poros/store/nf4_checkpoint.py).

Peak memory is the store plus about one bf16 decoder layer: each layer is materialised on the
build device, its linears quantized to NF4 straight into the host arena, then freed.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch
from torch import nn

from poros.errors import CheckpointError
from poros.models.checkpoint import CheckpointReader, Source, resolve
from poros.models.skeleton import (
    check_supported,
    decoder_layers,
    layer_linears,
    persistent_buffers,
    skeleton,
)
from poros.store.arena import NF4Store, host_buffer
from poros.store.layout import LayerLayout, plan_layout
from poros.store.host_memory import HostNeed, check_host_memory, host_need
from poros.store.nf4_checkpoint import NF4CheckpointLayers, is_bnb_checkpoint
from poros.store.progress import BuildStats, LayerProgress
from poros.store.quantize import Codes, quantize_nf4, write_slot

LAYER_SEED_STRIDE = 1_000_003


def _fill(module: nn.Module, model: nn.Module, prefix: str, device, seed: int | None, reader) -> None:
    """Materialise `module`'s own parameters on `device`: seeded init or read from the checkpoint.
    Persistent buffers keep their constructed values unless the checkpoint has them."""
    defaults = {n: b.detach().clone() for n, b in persistent_buffers(module)}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in persistent_buffers(module):
            b.copy_(defaults[n])
        if reader is None:
            with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
                torch.manual_seed(seed)
                module.apply(model._init_weights)
        else:
            for name, p in module.named_parameters():
                p.copy_(reader.get(f"{prefix}.{name}" if prefix else name, like=p).to(p.dtype))
            for name, b in persistent_buffers(module):
                full = f"{prefix}.{name}" if prefix else name
                if reader.has(full):
                    b.copy_(reader.get(full, like=b).to(b.dtype))


class LayerSource(Protocol):
    """Where a store's weights come from: what the build loop (`build_from`) asks of each source."""

    what: str  # the progress line's verb ("building", "loading")
    config: object  # the model config the store is laid out by
    double_quant: bool  # the slots hold a double-quantized absmax (poros/store/arena.py)
    codes: Codes  # the lookup tables, once a layer has given them

    def host_need(self, model: nn.Module, layers: nn.ModuleList, arena_bytes: int) -> HostNeed | None:
        """What the build takes in host memory (None: not checked)."""

    def fill_layer(self, model: nn.Module, layer: nn.Module, index: int, prefix: str, layout: LayerLayout,
                   arena: torch.Tensor, dense: dict, buffers: dict) -> None:
        """Layer `index`'s NF4 slots into `arena`, its other weights into `dense`, its persistent buffers into
        `buffers` (host tensors by full name)."""

    def fill_rest(self, model: nn.Module, layers: nn.ModuleList, dense: dict) -> None:
        """The weights outside the decoder layers (embeddings, final norm, lm_head) into `dense`."""


class Bf16Layers:
    """Each layer materialised on the build device (seeded init, or read from a bf16/fp16 checkpoint) and its
    linears quantized to NF4 straight into the arena, then freed."""

    what = "building"

    def __init__(self, src: Source, seed: int, device: torch.device, double_quant: bool = False):
        self.config, self.seed, self.device, self.double_quant = src.config, seed, device, double_quant
        self.reader = CheckpointReader(src.checkpoint) if src.checkpoint else None
        self.codes = Codes()

    def host_need(self, model, layers, arena_bytes):
        return host_need(model, layers, arena_bytes, self.device)

    def fill_layer(self, model, layer, index, prefix, layout, arena, dense, buffers):
        _fill(layer, model, prefix, self.device, self.seed * LAYER_SEED_STRIDE + index, self.reader)
        linears = dict(layer.named_modules())
        for slot in layout.slots:
            w = linears[slot.name[len(prefix) + 1 :]].weight.detach()
            packed, state = quantize_nf4(w.to(torch.bfloat16), self.double_quant)
            write_slot(arena, slot, packed, state)
            self.codes.take(state)
        for name, p in layer.named_parameters():
            if not (name.endswith(".weight") and isinstance(linears[name.rsplit(".", 1)[0]], nn.Linear)):
                dense[f"{prefix}.{name}"] = p.detach().to("cpu", copy=True)
        for name, b in persistent_buffers(layer):
            buffers[f"{prefix}.{name}"] = b.detach().to("cpu", copy=True)
        layer.to("meta")

    def fill_rest(self, model, layers, dense):
        device = self.device
        in_layers = {id(p) for p in layers.parameters()}
        tied = getattr(self.config, "tie_word_embeddings", False)
        for k, (mname, module) in enumerate(model.named_modules()):
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in in_layers]
            own = [(n, p) for n, p in own if p.is_meta and not (tied and f"{mname}.{n}" == "lm_head.weight")]
            if not own:
                continue
            module.to_empty(device=device, recurse=False)
            with torch.no_grad():
                if self.reader is None:
                    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                        torch.manual_seed(self.seed * LAYER_SEED_STRIDE - 1 - k)  # apart from every layer's seed
                        model._init_weights(module)
                else:
                    for n, p in module.named_parameters(recurse=False):
                        p.copy_(self.reader.get(f"{mname}.{n}", like=p).to(p.dtype))
            for n, p in module.named_parameters(recurse=False):
                dense[f"{mname}.{n}" if mname else n] = p.detach().to("cpu", copy=True)
            module.to("meta")


def build_store(
    source: Source | str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    double_quant: bool = False,
    progress: bool | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> tuple[NF4Store, BuildStats]:
    """Build the NF4 store of `source` layer by layer on `device`: seeded random weights, a bf16/fp16
    checkpoint quantized here, or a bitsandbytes NF4 checkpoint read as it is (poros/store/nf4_checkpoint.py).
    With `double_quant` every slot's absmax is quantized again, as bitsandbytes' `compress_statistics` does
    (the `double_quant` setting: a run's store must agree with it).

    `allocate(nbytes)` gives the zeroed host bytes of the arena (by default private memory;
    `poros.engine.parallel.distributed` passes memory the ranks of a host share).

    Returns:
        The host-resident store and the build's time and peak device memory.
    """
    src = resolve(source) if isinstance(source, str) else source
    device = torch.device(device)
    if src.checkpoint is not None and is_bnb_checkpoint(src.checkpoint):  # already quantized: read, not built
        layer_source = NF4CheckpointLayers(src, device, double_quant)
    else:
        layer_source = Bf16Layers(src, seed, device, double_quant)
    return build_from(src.name, layer_source, device=device, progress=progress, on_layer=on_layer,
                      allocate=allocate)


def build_from(name: str, source: LayerSource, *, device: torch.device, progress: bool | None = None,
               on_layer: Callable[[int, int], None] | None = None,
               allocate: Callable[[int], torch.Tensor] | None = None) -> tuple[NF4Store, BuildStats]:
    """The build loop every source shares: skeleton, arena layout, arena, then layer by layer (peak memory
    about the store plus one decoder layer), then the weights outside the layers."""
    t0 = time.perf_counter()
    model = skeleton(source.config)
    try:
        list_name, layers = decoder_layers(model)
    except CheckpointError as e:
        raise CheckpointError(f"{name}: {e}") from None
    check_supported(name, layers, list_name)
    prefixes = [f"{list_name}.{i}" for i in range(len(layers))]
    layouts, total = plan_layout([layer_linears(layer, p) for layer, p in zip(layers, prefixes)], source.double_quant)
    need = source.host_need(model, layers, total)
    if need is not None:
        check_host_memory(name, need)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    arena = (allocate or host_buffer)(total)
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    report = LayerProgress(f"{source.what} {name}", len(layers), progress, on_layer)
    for i, (layer, prefix, layout) in enumerate(zip(layers, prefixes, layouts)):
        source.fill_layer(model, layer, i, prefix, layout, arena, dense, buffers)
        report(i + 1)
    report.done()
    source.fill_rest(model, layers, dense)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    store = NF4Store(source.config, layouts, arena, dense, source.codes.code, source=name, buffers=buffers,
                     nested_code=source.codes.nested)
    return store, BuildStats(time.perf_counter() - t0, total, len(layers), str(device), peak)
