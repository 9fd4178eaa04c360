"""The host memory a build takes, from the model's shapes alone, and the check that refuses a build the
host cannot hold."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from poros.errors import PorosError
from poros.models.skeleton import (
    decoder_layers,
    layer_linears,
    persistent_buffers,
    skeleton,
)
from poros.store.layout import plan_layout

if TYPE_CHECKING:  # the check runs on a skeleton, which imports it: importing the check loads no torch
    from torch import nn

SKIP_MEMORY_CHECK = "POROS_SKIP_MEMORY_CHECK"


QUANTIZE_PEAK = 7  # host bytes bitsandbytes' CPU quantize_4bit holds per byte of its bf16 input


# room left beyond the estimate: MemAvailable is itself an estimate, and allocator slack, the page
# cache of a checkpoint being read and other processes all take some; a build that would leave
# less than this is refused rather than run to the edge of the host's memory
MEMORY_HEADROOM = 0.10


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class HostNeed:
    """Host memory a build takes, from the model's shapes alone."""

    arena: int  # the NF4 decoder weights with their absmax
    dense: int  # every other weight (embeddings, lm_head, norms, biases) and the layers' persistent buffers
    transient: int  # held only during a CPU build: one bf16 layer and its quantization, or a dense weight's copy

    @property
    def store(self) -> int:
        return self.arena + self.dense

    @property
    def total(self) -> int:
        return self.arena + self.dense + self.transient


def host_need(model: nn.Module, layers: nn.ModuleList, arena_bytes: int, device) -> HostNeed:
    import torch
    from torch import nn

    in_layers = {id(p) for p in layers.parameters()}
    tied = getattr(model.config, "tie_word_embeddings", False)  # the build keeps one copy (embed_tokens)
    outside = [p for n, p in model.named_parameters() if id(p) not in in_layers and not (tied and n == "lm_head.weight")]
    layer_dense = [p for layer in layers for n, p in layer.named_parameters()
                   if not (n.endswith(".weight") and isinstance(layer.get_submodule(n.rsplit(".", 1)[0]), nn.Linear))]
    buffers = [b for layer in layers for _, b in persistent_buffers(layer)]
    transient = 0
    if torch.device(device).type == "cpu":
        # one bf16 layer, plus what bitsandbytes' CPU quantize_4bit holds while quantizing its largest
        # linear (QUANTIZE_PEAK); or a dense weight's copy
        linears = [m.weight for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
        biggest_layer = max((_nbytes(layer.parameters()) for layer in layers), default=0)
        quantize = QUANTIZE_PEAK * max((_nbytes([w]) for w in linears), default=0)
        transient = max(biggest_layer + quantize, max((_nbytes([p]) for p in outside), default=0))
    return HostNeed(arena_bytes, _nbytes(outside) + _nbytes(layer_dense) + _nbytes(buffers), transient)


def config_host_need(config, device, double_quant: bool = False) -> HostNeed:
    """What building `config` on `device` takes in host memory, from its shapes alone."""
    model = skeleton(config)
    list_name, layers = decoder_layers(model)
    _, total = plan_layout([layer_linears(layer, f"{list_name}.{i}") for i, layer in enumerate(layers)],
                           double_quant)
    return host_need(model, layers, total, device)


def store_bytes(config, double_quant: bool = False) -> int:
    """Host bytes of the NF4 store of `config` (arena, dense weights, buffers), from its shapes alone."""
    return config_host_need(config, "meta", double_quant).store


def available_host_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup memory limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap, used = Path(limit).read_text().strip(), Path(usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:
            found.append(max(0, int(cap) - int(used)))
    return min(found) if found else None


def process_host_memory() -> int | None:
    """Bytes of host memory this process holds (VmRSS: page-locked store and saved inputs included), None where
    /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def host_memory_text() -> str:
    """'host: 38.2 GB available, 52.1 GB held by this process' (what /proc says of both; '' where it says neither):
    the log's record of host memory, so a run the system ends for want of it leaves the figures behind."""
    available, held = available_host_memory(), process_host_memory()
    parts = [f"{available / 1e9:.1f} GB available" if available is not None else "",
             f"{held / 1e9:.1f} GB held by this process" if held is not None else ""]
    return f"host: {', '.join(p for p in parts if p)}" if any(parts) else ""


def check_host_memory(name: str, need: HostNeed, available: int | None = None) -> None:
    """Refuse a build that would not fit in host memory, before anything is allocated.

    Raises:
        PorosError: naming what the build needs, what is available and what to do.
    """
    available = available_host_memory() if available is None else available
    wanted = int(need.total * (1 + MEMORY_HEADROOM))
    if available is None or os.environ.get(SKIP_MEMORY_CHECK) == "1" or wanted <= available:
        return
    parts = f"NF4 store {need.arena / 1e9:.1f} GB + bf16 embeddings and norms {need.dense / 1e9:.1f} GB"
    if need.transient:
        parts += f" + {need.transient / 1e9:.1f} GB while a layer is built on the CPU"
    raise PorosError(f"building {name} needs about {need.total / 1e9:.1f} GB of host memory ({parts}), "
                     f"{wanted / 1e9:.1f} GB with {MEMORY_HEADROOM:.0%} headroom; {available / 1e9:.1f} GB is "
                     f"available: free memory or use a larger machine ({SKIP_MEMORY_CHECK}=1 tries anyway)")
