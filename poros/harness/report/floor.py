"""How far a streamed step is from what bounds it from below, derived from saved rows alone.

A row of a streamed step carries its copy floor (`copy_floor_s`: its weight bytes over the host->device link at the
better of its process's probe and its own copies' rate, poros/harness/link.py); a page takes it again at its run's
link figure (`link_gbps`: the best of the run's probes and the rates its steps' weight copies reached,
`link.link_figure`). Its compute floor is the fastest step of the same work with nothing streamed, of the same model,
stack and computed settings (poros/settings.py), in the same run on the same GPU. The same work counts the recompute:
a poros plan runs the forward of every layer again in its backward from the layer's saved input (all but resident
layers that keep their activations), which resident QLoRA does not and resident_gc does. So the floor is the fastest
step that recomputes every layer (resident_gc, its offloading form, or a plan that copies no bytes and keeps no
activations) for the share of layers the row recomputes, and the fastest that recomputes none (resident QLoRA) for
the rest, in proportion; where the run has only one of the two, that one (resident's alone leaves the recompute out,
and the time beyond the floor then holds it). A matrix runs a model's references before its poros cells, so a
streamed row carries its floors when it is written (`floor_fields`); a page finds them again among all its rows, for
rows written before their reference. `floor_share` is the larger floor over the step's s/step (100%: a step at its
floor), `host_s_per_step` what the step takes beyond it.
"""

from __future__ import annotations

import pandas as pd

from poros.engine.methods.method_info import REFERENCES, by_value, is_planned
from poros.engine.planning.search import kept_set
from poros.harness.link import copy_floor, link_figure
from poros.harness.report.format import DASH, num
from poros.harness.report.rows import computed_key, run_of
from poros.harness.report.schedule import schedule_floor

FLOOR_NOTE = ("Floor share: the larger of a step's two floors over its s/step (100%: the step runs at its floor). "
              "The copy floor is its weight bytes over the host→device link: the best of the pinned copy probes of "
              "its run and the rates its run's weight copies reached (Link; above the probe where a probe read low); "
              "the compute floor the fastest step of the same model and computed settings with nothing streamed in "
              "the same run on the same GPU, recompute counted: for the layers the plan "
              "recomputes, the fastest step that runs every layer's forward again in backward as poros recomputes "
              "its streamed layers (a poros plan that copies nothing, or resident_gc), for the rest resident "
              "QLoRA's, or the one of the two the run has (— where neither ran: the share is then the copy "
              "floor's). Beyond the floor: the step's s/step less the larger floor (`host_s_per_step`). Schedule "
              "floor: the step the plan's order of loads and layers allows on a host that launches at no cost, at the "
              "row's link and compute floor (each layer's and the head's share of the compute floor in proportion "
              "to their FLOPs): above the larger floor where the plan holds the link idle (blocks reused across "
              "the step's ends, resident layers with nothing left to load) or the compute waits for a load. "
              "Beyond the schedule: the step's s/step less it, the time the host adds.")


def streams_nothing(row: dict) -> bool:
    """Whether a row's step computes with every weight on the device: a reference method (resident QLoRA and its
    checkpointed form), or a plan that copied no bytes host->device. Unsloth computes other arithmetic."""
    return row["method"] in REFERENCES or (is_planned(row["method"]) and num(row.get("bytes_h2d_per_step")) == 0)


def _timed(row: dict) -> float | None:
    """A row's s/step where it was timed (status ok, not a control) and is a positive number, else None."""
    s = num(row.get("s_per_step_median"))
    return s if row["status"] == "ok" and row.get("control") is not True and s and s > 0 else None


def recomputed_share(row: dict) -> float:
    """The share of a row's layers whose forward its backward runs again from their saved input: every layer of a
    method that recomputes (resident_gc), none of resident QLoRA's, and of a poros plan's all but the resident
    layers that keep their activations (the plan's `kept_layers` where the row records them, else `kept_set` of its
    plan's resident layers as `keep_activations` and `kept_layers` say)."""
    if not is_planned(row["method"]):
        info = by_value(row["method"])
        return 1.0 if info is not None and info.recomputes else 0.0
    plan, config = row.get("plan"), row.get("config") or {}
    resident = tuple(plan.get("resident_layers") or ()) if isinstance(plan, dict) else ()
    layers = len(resident) + len(plan.get("streamed_layers") or []) if isinstance(plan, dict) else 0
    if not layers:
        return 1.0
    if "kept_layers" in plan:
        return 1.0 - len(plan["kept_layers"] or ()) / layers
    if not config.get("keep_activations"):
        return 1.0
    return 1.0 - len(kept_set(resident, config.get("kept_layers"))) / layers


def compute_floors(rows: list[dict]) -> dict[tuple, dict[float, float]]:
    """The fastest s/step with nothing streamed per (run, computed settings) among `rows`, apart for the steps that
    recompute every layer (1.0) and those that recompute none (0.0)."""
    out: dict[tuple, dict[float, float]] = {}
    for r in rows:
        s = _timed(r)
        share = recomputed_share(r) if s is not None and streams_nothing(r) else None
        if share in (0.0, 1.0):
            floors = out.setdefault((run_of(r), computed_key(r)), {})
            floors[share] = min(s, floors.get(share, s))
    return out


def _compute_floor(floors: dict[float, float], share: float) -> float | None:
    """The compute floor of a step that recomputes `share` of its layers: in proportion between the fastest step
    recomputing none and the fastest recomputing all, or the one of them there is (None: neither)."""
    none, every = floors.get(0.0), floors.get(1.0)
    if none is not None and every is not None:
        return none + share * (every - none)
    return every if none is None else none


FLOOR_FIELDS = ("compute_floor_s", "floor_share", "host_s_per_step", "schedule_floor_s", "beyond_schedule_s")


def floor_fields(row: dict, floors: dict[tuple, dict[float, float]]) -> dict:
    """A row's `compute_floor_s` (None where no step of the same work streamed nothing in the same run and GPU),
    `floor_share` and `host_s_per_step` (None where the row has no copy floor or no timing), given the compute
    floors of its run (`compute_floors`). A streamed step takes the larger of its two floors plus what its plan's
    order and the host add: `host_s_per_step` is that remainder, its s/step less the larger floor;
    `schedule_floor_s` the step the plan's order allows on an ideal host (poros/harness/report/schedule.py, None
    where it cannot be modelled) and `beyond_schedule_s` what the step takes beyond it, the host's share alone."""
    copy, s = num(row.get("copy_floor_s")), _timed(row)
    found = floors.get((run_of(row), computed_key(row))) if copy is not None else None
    floor = None if not found else _compute_floor(found, recomputed_share(row))
    bound = None if copy is None or s is None else max(copy, floor or 0.0)
    # only at a compute floor that recomputes (the recompute's share of resident's step is not extrapolated)
    schedule = None if bound is None or 1.0 not in (found or {}) else schedule_floor(row, floor)
    return {"compute_floor_s": floor, "floor_share": None if bound is None else bound / s,
            "host_s_per_step": None if bound is None else s - bound, "schedule_floor_s": schedule,
            "beyond_schedule_s": None if schedule is None else s - schedule}


def run_links(rows: list[dict]) -> dict[str, float | None]:
    """Each run's link figure in GB/s (`link.link_figure`) from its rows that carry a link probe: their probes and
    the rates their weight copies reached."""
    seen: dict[str, list] = {}
    for r in rows:
        probe = num(r.get("link_h2d_gbps"))
        if probe is not None:
            seen.setdefault(run_of(r), []).extend((probe, num(r.get("copy_gbps"))))
    return {run: link_figure(rates) for run, rates in seen.items()}


def with_link(row: dict, links: dict[str, float | None]) -> dict:
    """`row` with its run's link figure (`link_gbps`) and its copy floor taken at it, for a row with a probe and its
    weight bytes; other rows as they are."""
    link = links.get(run_of(row)) if num(row.get("link_h2d_gbps")) is not None else None
    weights = num(row.get("weight_bytes_h2d_per_step"))
    if link is None or not weights:
        return {**row, "link_gbps": num(row.get("link_h2d_gbps"))}
    return {**row, "link_gbps": link, "copy_floor_s": copy_floor(int(weights), link)}


LINK_FIELDS = ("link_gbps", "copy_floor_s")


def with_floors(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with its run's link figure and the copy floor at it (`with_link`) and `floor_fields` for every row, the
    compute floors found among all of `df`'s rows (a row written before its run's resident one carries none of its
    own)."""
    records = df.to_dict("records")
    links = run_links(records)
    rows = [with_link(r, links) for r in records]
    floors = compute_floors(rows)
    fields = [{**{k: r.get(k) for k in LINK_FIELDS}, **floor_fields(r, floors)} for r in rows]
    return df.assign(**{k: pd.Series([f[k] for f in fields], index=df.index, dtype=object)
                        for k in (*LINK_FIELDS, *FLOOR_FIELDS)})


def probed(df: pd.DataFrame) -> bool:
    """Whether any row carries a link probe (rows from before it was recorded carry none)."""
    return "link_h2d_gbps" in df and any(num(v) is not None for v in df["link_h2d_gbps"])


def floor_cells(row: dict) -> list[str]:
    """Link, copy floor, compute floor, floor share, the time beyond the floor, the schedule floor and the time beyond
    it as a page shows them (a row of `with_floors`), — for what a row lacks."""
    link, copy = num(row.get("link_gbps")), num(row.get("copy_floor_s"))
    compute, share = num(row.get("compute_floor_s")), num(row.get("floor_share"))
    host, schedule = num(row.get("host_s_per_step")), num(row.get("schedule_floor_s"))
    beyond = num(row.get("beyond_schedule_s"))
    return [DASH if link is None else f"{link:.1f} GB/s", DASH if copy is None else f"{copy:.4f} s",
            DASH if compute is None else f"{compute:.4f} s", DASH if share is None else f"{share * 100:.0f}%",
            DASH if host is None else f"{host:+.4f} s", DASH if schedule is None else f"{schedule:.4f} s",
            DASH if beyond is None else f"{beyond:+.4f} s"]


FLOOR_COLUMNS = ("Link", "Copy floor", "Compute floor", "Floor share", "Beyond the floor", "Schedule floor",
                 "Beyond the schedule")
