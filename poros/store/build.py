"""Build the NF4 store layer by layer: synthetic (seeded random init) or from a local checkpoint.

Peak memory is the store plus about one bf16 decoder layer: each layer is materialised on the
build device, its linears quantized to NF4 straight into the host arena, then freed.
"""

from __future__ import annotations

import time
from typing import Callable

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
from poros.store.arena import (
    NF4Store,
    absmax_view,
    host_buffer,
    plan_layout,
    weight_view,
)
from poros.store.host_memory import check_host_memory, host_need
from poros.store.nf4_checkpoint import is_bnb_checkpoint, load_nf4_store
from poros.store.progress import BuildStats, LayerProgress
from poros.store.quantize import quantize_nf4

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


def build_store(
    source: Source | str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> tuple[NF4Store, BuildStats]:
    """Build the NF4 store of `source` layer by layer on `device`.

    `allocate(nbytes)` gives the zeroed host bytes of the arena (by default private memory;
    `poros.engine.distributed` passes memory the ranks of a host share).

    Returns:
        The host-resident store and the build's time and peak device memory.
    """
    src = resolve(source) if isinstance(source, str) else source
    if src.checkpoint is not None:

        if is_bnb_checkpoint(src.checkpoint):  # already quantized: read, do not build
            return load_nf4_store(src, device=device, progress=progress, on_layer=on_layer, allocate=allocate)
    device = torch.device(device)
    t0 = time.perf_counter()
    model = skeleton(src.config)
    try:
        list_name, layers = decoder_layers(model)
    except CheckpointError as e:
        raise CheckpointError(f"{src.name}: {e}") from None
    check_supported(src.name, layers, list_name)
    prefixes = [f"{list_name}.{i}" for i in range(len(layers))]
    layouts, total = plan_layout([layer_linears(layer, p) for layer, p in zip(layers, prefixes)])
    check_host_memory(src.name, host_need(model, layers, total, device))
    reader = CheckpointReader(src.checkpoint) if src.checkpoint else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    arena = (allocate or host_buffer)(total)
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    code = None
    report = LayerProgress(f"building {src.name}", len(layers), progress, on_layer)
    for i, (layer, prefix, layout) in enumerate(zip(layers, prefixes, layouts)):
        _fill(layer, model, prefix, device, seed * LAYER_SEED_STRIDE + i, reader)
        linears = dict(layer.named_modules())
        for slot in layout.slots:
            w = linears[slot.name[len(prefix) + 1 :]].weight.detach()
            packed, state = quantize_nf4(w.to(torch.bfloat16))
            weight_view(arena, slot).copy_(packed.reshape(-1, 1))
            absmax_view(arena, slot).copy_(state.absmax.float())
            code = state.code if code is None else code
        for name, p in layer.named_parameters():
            if not (name.endswith(".weight") and isinstance(linears[name.rsplit(".", 1)[0]], nn.Linear)):
                dense[f"{prefix}.{name}"] = p.detach().to("cpu", copy=True)
        for name, b in persistent_buffers(layer):
            buffers[f"{prefix}.{name}"] = b.detach().to("cpu", copy=True)
        layer.to("meta")
        report(i + 1)
    report.done()
    in_layers = {id(p) for p in layers.parameters()}
    tied = getattr(src.config, "tie_word_embeddings", False)
    for k, (mname, module) in enumerate(model.named_modules()):
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in in_layers]
        own = [(n, p) for n, p in own if p.is_meta and not (tied and f"{mname}.{n}" == "lm_head.weight")]
        if not own:
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if reader is None:
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seed * LAYER_SEED_STRIDE - 1 - k)  # apart from every layer's seed
                    model._init_weights(module)
            else:
                for n, p in module.named_parameters(recurse=False):
                    p.copy_(reader.get(f"{mname}.{n}", like=p).to(p.dtype))
        for n, p in module.named_parameters(recurse=False):
            dense[f"{mname}.{n}" if mname else n] = p.detach().to("cpu", copy=True)
        module.to("meta")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    store = NF4Store(src.config, layouts, arena, dense, code.to("cpu"), source=src.name, buffers=buffers)
    return store, BuildStats(time.perf_counter() - t0, total, len(layers), str(device), peak)
