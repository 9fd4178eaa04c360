"""A streamed row's schedule floor: the step its plan's order allows the device on an ideal host
(poros/engine/planning/timeline.py), at the link its process probed and the compute floor of its run. It lies
between the larger of the two floors and the measured step: above the floors by the time the plan holds the link
idle (blocks reused across the step's ends, resident layers computing with nothing left to load) or the compute
waiting for a load; below the step by what the host adds.

The plan is built again from the row's settings and kept only where it is the one the row ran (its resident layers,
block size, lm_head, host-held inputs and bytes a step, as the row records them). Where the budget search no longer
makes that plan (a planner whose memory model changed since, a budget made against a device's memory: `vram_budget:
auto`, what the process held), it is built again with the residency the row records, and kept where that comes out
as the plan that ran."""

from __future__ import annotations

import functools
import json
from dataclasses import replace

from poros.config import TrainConfig
from poros.errors import PorosError
from poros.engine.methods.method_info import is_planned
from poros.harness.report.format import num
from poros.sizes import is_auto

# what must agree (kept_layers also tells `_as_ran` which layers recompute)
MATCHED = ("resident_layers", "block_size", "head_resident", "host_inputs", "h2d_bytes_per_step", "kept_layers")


@functools.lru_cache(maxsize=256)
def _rebuilt(config: str, recorded: str):
    """(plan, geometry, settings) of a row's where the plan built again is the one recorded, else None."""
    from poros.engine.planning.budget import make_plan
    from poros.engine.planning.geometry import Geometry
    from poros.models.checkpoint import resolve

    ran = json.loads(recorded)
    try:
        settings = json.loads(config)
        cfg = TrainConfig.from_settings(settings, model=settings["model"])
        geo = Geometry.of_config(cfg.model, resolve(cfg.model).config, cfg.lora_targets, cfg.double_quant)
    except (PorosError, ValueError, KeyError, TypeError, OSError):  # settings or model not known here
        return None
    for build in (lambda: make_plan(geo, cfg), lambda: _as_ran(geo, cfg, ran)):
        try:
            plan = build()
        except (PorosError, ValueError, KeyError, TypeError):  # a budget no plan fits here, a residency it refuses
            continue
        if plan is not None and _ran(plan, ran):
            return plan, geo, cfg
    return None


def _ran(plan, ran: dict) -> bool:
    """Whether `plan` is the one a row recorded (`ran`: its MATCHED fields)."""
    summary = plan.summary()
    return all(summary.get(k) == ran[k] for k in MATCHED if k in ran)


def _as_ran(geo, cfg: TrainConfig, ran: dict):
    """The plan with the residency `ran` records (resident layers, block size, lm_head, saved inputs on the device),
    built without a budget search; None where the row records no residency."""
    from poros.engine.planning.search import PlanRequest, build_plan

    if not all(k in ran for k in ("resident_layers", "block_size", "head_resident", "host_inputs")):
        return None
    kept = ran.get("kept_layers") or ()
    if is_auto(cfg.keep_activations):  # the search chose the kept layers: as many as the row records
        cfg = cfg.replace(keep_activations=bool(kept), kept_layers=len(kept) or None)
    request = PlanRequest.of_config(cfg.replace(vram_budget=None, block_size=ran["block_size"]))
    recomputed = geo.n_layers - len(kept)
    return build_plan(geo, replace(request, resident_layers=len(ran["resident_layers"]),
                                   head_resident=ran["head_resident"],
                                   device_inputs=recomputed - len(ran["host_inputs"])))


def plan_as_ran(row: dict):
    """(plan, geometry, settings) of a results row whose plan can be built again as it ran, else None."""
    plan, config = row.get("plan"), row.get("config")
    if not isinstance(plan, dict) or not isinstance(config, dict):
        return None
    return _rebuilt(json.dumps(config, sort_keys=True, default=str),
                    json.dumps({k: plan[k] for k in MATCHED if k in plan}, sort_keys=True))


def schedule_floor(row: dict, compute_floor_s: float | None) -> float | None:
    """The row's schedule floor in seconds at its run's link figure (`link_gbps`, as `floor.with_floors` adds it; the
    row's probe where it has none), None where it has no plan, link probe or compute floor, shares its copies
    among ranks, or its plan cannot be built again as it ran). `compute_floor_s` must count the recompute the plan
    runs (a step that recomputes, not resident QLoRA's alone: the recompute's share of it is not extrapolated)."""
    link, plan = num(row.get("link_gbps", row.get("link_h2d_gbps"))), row.get("plan")
    config = row.get("config")
    if not is_planned(row["method"]) or not isinstance(plan, dict) or not isinstance(config, dict):
        return None
    if link is None or link <= 0 or not compute_floor_s or (plan.get("shards") or 1) > 1:
        return None
    rebuilt = plan_as_ran(row)
    if rebuilt is None:
        return None
    from poros.engine.planning.timeline import CostModel, simulate

    built, geo, cfg = rebuilt
    costs = CostModel.of(built, geo, cfg.seq_len * cfg.batch_size, cfg.seq_len, compute_floor_s, link * 1e9)
    return simulate(built, costs).step_s
