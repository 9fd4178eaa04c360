"""The plan a `poros train` run takes, in one line: method and device, what is computed (attention,
determinism), how poros schedules it (layers resident and streamed, predicted peak, CUDA graphs), and
which settings took the GPU's defaults."""

from __future__ import annotations

import torch

from poros.config import Method
from poros.engine.runtime.nvml import device_memory
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.inputs import HostMemory
from poros.engine.planning.plan import Plan
from poros.engine.planning.budget import make_plan
from poros.sizes import format_size, is_auto
from poros.store.host_memory import available_host_memory


def dry_plan(fc, source) -> Plan | None:
    """The plan poros would run for `fc` on the model `source` (None for resident). `vram_budget: auto`
    reads the device's free memory, so without a device it is left to the run."""
    cfg = fc.train
    if fc.method is not Method.POROS:
        return None
    device = None
    if is_auto(cfg.vram_budget):
        if cfg.device.value != "cuda" or not torch.cuda.is_available():
            return None
        device = device_memory(torch.device("cuda"))
    available = available_host_memory()  # `host_budget: auto`: this machine's, before the store is built
    return make_plan(Geometry.of_config(cfg.model, source.config, cfg.lora_targets, cfg.double_quant), cfg, device,
                     host=None if available is None else HostMemory(available))


def plan_line(fc, plan: Plan | None, device_defaults: tuple[str, ...] = ()) -> str:
    """One line: `plan: poros on cuda; attention fast (deterministic); 64 layers: 40 resident, 24
    streamed in blocks of 4, predicted peak 118.2 GB (budget auto: 121.0 GB); CUDA-graph layers; ...`."""
    cfg = fc.train
    parts = [f"{fc.method.value} on {cfg.device.value}" + (f", {cfg.gpus} ranks" if cfg.gpus > 1 else ""),
             f"attention {cfg.attention.value}" + (" (deterministic)" if cfg.deterministic else "")]
    if fc.method is Method.POROS:
        if plan is not None:
            budget = f" (budget {'auto: ' if is_auto(cfg.vram_budget) else ''}{format_size(plan.budget)})" \
                if plan.budget else ""
            parts.append(f"{plan.n_layers} layers: {len(plan.resident_layers)} resident, {len(plan.streamed_layers)} "
                         f"streamed in blocks of {plan.block_size}, predicted peak "
                         f"{format_size(plan.memory.total)}{budget}")
            if plan.kept_layers:
                parts.append(f"activations kept in {len(plan.kept_layers)} of them (no recompute)")
            if plan.host_inputs:
                parts.append(f"saved inputs of {len(plan.host_inputs)} layers in host memory "
                             f"({format_size(plan.host_input_bytes)}), {len(plan.device_input_layers)} on the device")
        elif is_auto(cfg.vram_budget):
            parts.append(f"vram_budget auto (planned from the free device memory at the start), blocks of "
                         f"{cfg.block_size}")
        parts.append("CUDA-graph layers" if cfg.cuda_graphs else "eager layers")
    if device_defaults:
        parts.append(f"defaults for {cfg.device.value}: {', '.join(device_defaults)} (set one to change it)")
    return "plan: " + "; ".join(parts)
