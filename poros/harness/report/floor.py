"""How far a streamed step is from what bounds it from below, derived from saved rows alone.

A row of a streamed step carries its copy floor (`copy_floor_s`: its weight bytes over the host->device link as
its own process measured it, poros/harness/link.py). Its compute floor is the fastest step of the same work with
nothing streamed: resident QLoRA, resident_gc, or a plan that copies no bytes, of the same model, stack and
computed settings (poros/settings.py), in the same run on the same GPU. A matrix runs a model's reference before
its poros cells, so a streamed row carries its floors when it is written (`floor_fields`); a page finds them again
among all its rows, for rows written before their reference. `floor_share` is the larger floor over the step's
s/step (100%: a step at its floor), `host_s_per_step` what the step takes beyond it.
"""

from __future__ import annotations

import pandas as pd

from poros.engine.methods.method_info import REFERENCES, is_planned
from poros.harness.report.format import DASH, num
from poros.harness.report.rows import computed_key, run_of

FLOOR_NOTE = ("Floor share: the larger of a step's two floors over its s/step (100%: the step runs at its floor). "
              "The copy floor is its weight bytes over the host→device link as a pinned copy probe measured it in "
              "the row's process; the compute floor the fastest step of the same model and computed settings with "
              "nothing streamed (resident QLoRA, or a plan that copies nothing) in the same run on the same GPU (— "
              "where none ran: the share is then the copy floor's). Beyond the floor: the step's s/step less the "
              "larger floor, the time the host adds (`host_s_per_step`).")


def streams_nothing(row: dict) -> bool:
    """Whether a row's step computes with every weight on the device: a reference method (resident QLoRA and its
    checkpointed form), or a plan that copied no bytes host->device. Unsloth computes other arithmetic."""
    return row["method"] in REFERENCES or (is_planned(row["method"]) and num(row.get("bytes_h2d_per_step")) == 0)


def _timed(row: dict) -> float | None:
    """A row's s/step where it was timed (status ok, not a control) and is a positive number, else None."""
    s = num(row.get("s_per_step_median"))
    return s if row["status"] == "ok" and row.get("control") is not True and s and s > 0 else None


def compute_floors(rows: list[dict]) -> dict[tuple, float]:
    """The fastest s/step with nothing streamed per (run, computed settings) among `rows`."""
    out: dict[tuple, float] = {}
    for r in rows:
        s = _timed(r)
        if s is not None and streams_nothing(r):
            key = (run_of(r), computed_key(r))
            out[key] = min(s, out.get(key, s))
    return out


def floor_fields(row: dict, floors: dict[tuple, float]) -> dict:
    """A row's `compute_floor_s` (None where no step of the same work streamed nothing in the same run and GPU),
    `floor_share` and `host_s_per_step` (None where the row has no copy floor or no timing), given the compute
    floors of its run (`compute_floors`). A streamed step takes the larger of its two floors plus what the host
    adds: `host_s_per_step` is that remainder, its s/step less the larger floor."""
    copy, s = num(row.get("copy_floor_s")), _timed(row)
    floor = floors.get((run_of(row), computed_key(row))) if copy is not None else None
    bound = None if copy is None or s is None else max(copy, floor or 0.0)
    return {"compute_floor_s": floor, "floor_share": None if bound is None else bound / s,
            "host_s_per_step": None if bound is None else s - bound}


def with_floors(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with `floor_fields` for every row, the compute floors found among all of `df`'s rows (a row written
    before its run's resident one carries none of its own)."""
    rows = df.to_dict("records")
    floors = compute_floors(rows)
    fields = [floor_fields(r, floors) for r in rows]
    return df.assign(**{k: pd.Series([f[k] for f in fields], index=df.index, dtype=object)
                        for k in ("compute_floor_s", "floor_share", "host_s_per_step")})


def probed(df: pd.DataFrame) -> bool:
    """Whether any row carries a link probe (rows from before it was recorded carry none)."""
    return "link_h2d_gbps" in df and any(num(v) is not None for v in df["link_h2d_gbps"])


def floor_cells(row: dict) -> list[str]:
    """Link, copy floor, compute floor, floor share and the host's time beyond the floor as a page shows them, — for
    what a row lacks."""
    link, copy = num(row.get("link_h2d_gbps")), num(row.get("copy_floor_s"))
    compute, share = num(row.get("compute_floor_s")), num(row.get("floor_share"))
    host = num(row.get("host_s_per_step"))
    return [DASH if link is None else f"{link:.1f} GB/s", DASH if copy is None else f"{copy:.4f} s",
            DASH if compute is None else f"{compute:.4f} s", DASH if share is None else f"{share * 100:.0f}%",
            DASH if host is None else f"{host:+.4f} s"]


FLOOR_COLUMNS = ("Link (probe)", "Copy floor", "Compute floor", "Floor share", "Beyond the floor")
