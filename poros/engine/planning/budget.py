"""The plan a run asks for (`make_plan`): the one its settings describe, or the one `plan_for_budget` finds, which
searches block size, residency, the lm_head's place and the saved inputs' place for the plan that copies the
fewest bytes within a VRAM budget. A plan whose host memory (the NF4 store and the saved inputs kept there)
exceeds its host budget is refused."""

from __future__ import annotations

from dataclasses import dataclass, replace

from poros.config import TrainConfig
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.inputs import HostMemory, host_refusal, least_on_device
from poros.engine.planning.memory import DeviceMemory, gb
from poros.engine.planning.plan import Plan
from poros.engine.planning.search import PlanRequest, assert_valid, build_plan
from poros.errors import BudgetError
from poros.sizes import format_size, is_auto


def make_plan(geo: Geometry, cfg: TrainConfig, device: DeviceMemory | None = None, ranks: int | None = None,
              host: HostMemory | None = None) -> Plan:
    """The plan a TrainConfig `cfg` asks for: every layer streamed, or the fastest whose process fits
    `cfg.vram_budget` (`device`: the CUDA device as the run found it, for its context and `vram_budget: auto`;
    `ranks`: the data-parallel ranks that run it, default `cfg.gpus`; `host`: this machine's host memory, for
    `host_budget: auto`).

    Raises:
        BudgetError: no plan fits the VRAM budget, or its host memory exceeds the host budget (one line each).
    """
    request = PlanRequest.of_config(cfg, device, ranks, host)
    if request.budget is not None:
        return plan_for_budget(geo, request)
    plan = build_plan(geo, request)
    refusal = host_refusal(plan, "the plan")
    if refusal:
        raise BudgetError(refusal)
    return plan


def plan_for_budget(geo: Geometry, request: PlanRequest) -> Plan:
    """The plan that copies the fewest bytes per step and whose process's predicted peak (`Memory.total`: the
    allocator's tensors, the CUDA graphs' pool, the allocator's reserve and the fixed costs) fits
    `request.budget`, its host memory `request.host_budget` (`search_budget`).

    Raises:
        BudgetError: no plan fits; names the smallest budget that would, or what the host memory holds.
    """
    best, seen = search_budget(geo, request)
    if best is None:
        raise BudgetError(refusal(geo, request, seen))
    return best


@dataclass
class Search:
    """What a budget search saw besides its answer: the smallest plan it built, the plan over the host budget
    that needs the least host memory, and how many layers' saved inputs the host holds where fewer than all."""

    smallest: Plan | None = None
    over_host: Plan | None = None
    host_holds: tuple[int, int] | None = None

    def note(self, p: Plan) -> None:
        if self.smallest is None or p.memory.total < self.smallest.memory.total:
            self.smallest = p


def search_budget(geo: Geometry, request: PlanRequest) -> tuple[Plan | None, Search]:
    """(the plan that copies the fewest bytes per step within `request.budget` and `request.host_budget`, None
    where none fits; what the search saw): the lm_head resident first (it saves its own copy and a reload), then
    as many layers as fit (placed as `placement` says: from the last one down, or spread), with the largest block
    size up to `block_size` that fits; saved inputs where `offload_inputs` (and `device_inputs`) place them, else
    all on the device or, where that copies fewer bytes, split: as many layers resident as fit beside the fewest
    saved inputs on the device the host allows, then as many saved inputs on the device as the rest of the budget
    holds. Weights come first: a resident layer saves two copies of its bytes a step (its loads in forward and in
    backward), a saved input on the device one (its copy back; the copy out runs in the direction the weights
    leave idle). `input_stride` is taken as the config gives it, never searched: what it saves is memory, what it
    costs is layer forwards, and the planner ranks plans by bytes copied alone, with no model of compute time to
    weigh the two."""
    cfg = request.config
    if is_auto(cfg.regenerated_layers) and cfg.input_stride > 1 and request.regenerated is None:
        return _fewest_regenerated(geo, request)
    seen = Search()
    placed = cfg.offload_inputs or request.device_inputs is not None
    best = None
    for block in range(cfg.block_size, 0, -1):
        for head in (True, False):
            tried = replace(request, config=cfg.replace(block_size=block), head_resident=head)
            fits = [_most_resident(geo, tried, seen.note)] + ([] if placed else [_split(geo, tried, seen)])
            for fit in fits:
                if fit is None:
                    continue
                if host_refusal(fit, "") is not None:
                    over = seen.over_host
                    seen.over_host = fit if over is None or fit.host_bytes < over.host_bytes else over
                elif best is None or fit.h2d_bytes_per_step < best.h2d_bytes_per_step:
                    best = fit
    if best is not None and is_auto(cfg.keep_activations):
        best = _kept_beside(geo, request, best)
    return (None if best is None else assert_valid(best)), seen


def _kept_beside(geo: Geometry, request: PlanRequest, best: Plan) -> Plan:
    """`keep_activations: auto`: where `best` keeps every layer resident (and every saved input on the device),
    the same plan with as many of its layers keeping their activations as `request.budget` holds beside it (at most
    `kept_layers`, spread evenly), else `best` as it is. Memory grows with the kept layers; no layer is given up
    for them, so the plan copies what `best` copies."""
    cfg = request.config
    n = geo.n_layers
    if best.streamed_layers or best.host_inputs:
        return best
    most = n if cfg.kept_layers is None else min(cfg.kept_layers, n)
    lo, hi = 1, most
    while lo <= hi:
        k = (lo + hi) // 2
        kept = replace(request, config=cfg.replace(keep_activations=True, kept_layers=k,
                                                   block_size=best.block_size),
                       resident_layers=n, head_resident=best.head_resident)
        p = build_plan(geo, kept, checked=False)
        if p.memory.total <= request.budget:
            best, lo = p, k + 1
        else:
            hi = k - 1
    return best


def _fewest_regenerated(geo: Geometry, request: PlanRequest) -> tuple[Plan | None, Search]:
    """`search_budget` for `regenerated_layers: auto`: the plan of the fewest regenerated inputs that fits (each
    one costs a layer forward a step; memory falls as their number grows). None where even every input
    input_stride allows regenerated does not fit, with what that search saw."""
    best, seen = search_budget(geo, replace(request, regenerated=geo.n_layers))
    lo, hi = 0, len(best.regenerated) - 1 if best is not None else -1
    while lo <= hi:
        k = (lo + hi) // 2
        fit, _ = search_budget(geo, replace(request, regenerated=k))
        if fit is None:
            lo = k + 1
        else:
            best, hi = fit, k - 1
    return best, seen


def refusal(geo: Geometry, request: PlanRequest, seen: Search, at: str = "", shorter: str = "a shorter --seq-len") -> str:
    """Why no plan fits `request`'s budgets (`at`: on which settings, where a search varies them), from what the
    search saw: the host budget where a plan fit the device but not the host, else the smallest plan's parts and
    the smallest budget that would hold it (or `shorter`: less work)."""
    budget = request.budget
    if seen.over_host is not None:
        return host_refusal(seen.over_host, f"the plan for vram_budget {format_size(budget)}{at}")
    m, smallest = seen.smallest.memory, seen.smallest
    beside = [f"{gb(v)} {name}" for name, v in (("CUDA-graph pool", m.graph_pool), ("allocator reserve",
              m.allocator_reserve), ("CUDA context", m.context), ("NCCL buffers", m.nccl),
              ("of tensors this process held before the run", m.held)) if v]
    graphs = " or --no-cuda-graphs" if m.graph_pool else ""
    held = seen.host_holds  # (layers whose inputs the host holds, of how many), where it holds fewer than all
    host = "" if held is None else (f"; host_budget {format_size(request.host_budget)} holds the saved inputs of "
                                    f"{held[0]} of {held[1]} layers beside the NF4 store ({gb(geo.store_bytes)}), the "
                                    "device the rest")
    return (f"vram_budget {format_size(budget)} is below the smallest plan for {geo.name}{at} "
            f"({gb(m.total)} for the process: {gb(m.planned)} of tensors with block size {smallest.block_size}, "
            f"every layer streamed, saved inputs in host memory where the host has room"
            + "".join(f", {b}" for b in beside)
            + f"); use --vram-budget {size_at_least(m.total)} or more, or {shorter}{graphs}{host}")


def _most_resident(geo: Geometry, request: PlanRequest, note) -> Plan | None:
    """The plan of `request` with the most resident layers whose process fits `request.budget` (None: not even
    with none); `note` sees every plan built."""
    lo, hi, fit = 0, geo.n_layers, None
    while lo <= hi:  # memory grows with the resident layers
        r = (lo + hi) // 2
        p = build_plan(geo, replace(request, resident_layers=r), checked=False)
        note(p)
        if p.memory.total <= request.budget:
            fit, lo = p, r + 1
        else:
            hi = r - 1
    return fit


def _split(geo: Geometry, request: PlanRequest, seen: Search) -> Plan | None:
    """The split plan of `request`: the most resident layers that fit beside the fewest saved inputs on the
    device that the host budget allows, then the most saved inputs on the device that fit beside them
    (`seen.host_holds`: how many layers' inputs the host holds, where fewer than all)."""
    probe, n, least = _fewest_on_device(geo, request)
    if least:
        seen.host_holds = (n - min(least, n), n)
    if least is None or least >= n:
        return None  # the host holds not even the store, or no saved input beside it: all on the device or none
    fit = _most_resident(geo, replace(request, device_inputs=least), seen.note)
    if fit is None:
        return None
    lo, hi = least + 1, len(probe.host_inputs) - 1
    while lo <= hi:  # device memory grows with the saved inputs kept there
        k = (lo + hi) // 2
        p = build_plan(geo, replace(request, device_inputs=k, resident_layers=len(fit.resident_layers)), checked=False)
        seen.note(p)
        if p.memory.total <= request.budget:
            fit, lo = p, k + 1
        else:
            hi = k - 1
    return fit


def _fewest_on_device(geo: Geometry, request: PlanRequest) -> tuple[Plan, int, int | None]:
    """(the plan of `request` with every recomputed layer's saved input in host memory, how many layers' inputs
    that is, the fewest of them on the device the host budget allows beside the NF4 store: None where it holds
    not even the store)."""
    probe = build_plan(geo, replace(request, device_inputs=0), checked=False)
    n = len(probe.host_inputs)
    return probe, n, least_on_device(n, probe.live_inputs, probe.input_slot, probe.store_bytes, probe.host_budget)


def smallest_request(geo: Geometry, request: PlanRequest) -> PlanRequest:
    """The request of the least device memory among the plans `search_budget` builds for `request`: block size 1,
    no layer resident, the lm_head streamed, and the saved inputs where `offload_inputs` puts them or, where the
    search may split them, the fewest on the device the host budget allows. Where its plan fits the budget, the
    search finds a plan; where it does not, only the search can say (a split it builds may place inputs
    otherwise)."""
    cfg = request.config
    least = replace(request, config=cfg.replace(block_size=1), resident_layers=0, head_resident=False)
    if cfg.offload_inputs or request.device_inputs is not None:
        return least
    _, n, fewest = _fewest_on_device(geo, least)
    return least if fewest is None or fewest >= n else replace(least, device_inputs=fewest)


def size_at_least(n: int) -> str:
    """`n` bytes rounded up to a tenth of its unit, as --vram-budget takes it."""
    unit, name = (10**9, "GB") if n >= 10**9 else (10**6, "MB") if n >= 10**6 else (10**3, "kB")
    return f"{-(-n * 10 // unit) / 10:g}{name}"
