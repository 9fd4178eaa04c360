"""The caching allocator held within a plan's VRAM budget (`AllocatorLimit`): what a poros trainer sets before its
first device allocation and gives back when it closes."""

from __future__ import annotations

import os

import torch

from poros.engine.planning import plan as P


def set_allocator_settings(conf: str) -> None:
    """torch's caching-allocator settings (PYTORCH_CUDA_ALLOC_CONF's syntax), applied now: they hold for every
    segment the allocator creates afterwards. torch.cuda.memory._set_allocator_settings became
    torch._C._accelerator_setAllocatorSettings (torch 2.10); neither is public yet."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


class AllocatorLimit:
    """Keeps torch's caching allocator on a CUDA device within what a plan's budget leaves it: the budget less
    the memory the process holds outside the allocator (`Memory.fixed`: context, NCCL).

    - A per-process memory fraction caps what the allocator reserves, CUDA graphs' pools included: past
      it, the allocator releases its cached blocks and tries again, and raises out-of-memory where that
      fails, instead of growing beyond the budget.
    - Expandable segments (unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF names the setting): one
      growing mapping per stream instead of hundreds of fixed segments, so a released block returns its
      pages and fragmentation does not hold memory that the cap would count. They are switched on at
      run time, not through the environment, because the setting holds for segments created after it
      and the trainer makes it before its first device allocation: it works for the CLI, scripts and
      library use alike, whatever touched CUDA first.

    Both are process-wide: `release` restores them, so a trainer built after this one (a parity gate's
    resident reference) runs on the allocator as it found it.
    """

    @staticmethod
    def holds(cfg) -> bool:
        """Whether a poros run on `cfg` (a TrainConfig) holds the allocator: a CUDA device and a budget."""
        return cfg.device.value == "cuda" and cfg.vram_budget is not None

    def __init__(self, plan: P.Plan, device: torch.device):
        self.fraction, self.expandable = None, False
        # set_per_process_memory_fraction takes an index: a bare "cuda" names the current device
        self.device = device = torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
        if device.type != "cuda" or plan.budget is None:
            return
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
        if "expandable_segments" not in conf:
            set_allocator_settings("expandable_segments:True")
            self.expandable = True
        torch.cuda.empty_cache()  # blocks cached before this trainer would count against its cap
        total = torch.cuda.get_device_properties(device).total_memory
        self.fraction = min(1.0, max(0.0, (plan.budget - plan.memory.fixed) / total))
        torch.cuda.set_per_process_memory_fraction(self.fraction, device)

    def release(self) -> None:
        if self.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.fraction = None
        if self.expandable:
            set_allocator_settings("expandable_segments:False")
            self.expandable = False


def held_text(device: torch.device) -> str:
    """What torch's allocator holds on `device` now, as an error names it: its tensors, what it reserved, and the
    share of that in CUDA graphs' private pools (every segment outside the default pool)."""
    if device.type != "cuda":
        return "no CUDA device"
    stats = torch.cuda.memory_stats(device)
    segments = torch.cuda.memory_snapshot()
    pools = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
    in_pools = sum(s["total_size"] for s in pools)
    return (f"held {stats.get('allocated_bytes.all.current', 0) / 1e9:.2f} GB of tensors, "
            f"{stats.get('reserved_bytes.all.current', 0) / 1e9:.2f} GB reserved, {in_pools / 1e9:.2f} GB of it in "
            f"{len({tuple(s['segment_pool_id']) for s in pools})} CUDA-graph pool(s)")
