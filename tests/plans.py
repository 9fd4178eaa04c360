"""Planner requests as tests write them: a run's settings and the residency to plan in one call."""

from __future__ import annotations

from dataclasses import fields

from poros.config import TrainConfig
from poros.engine.planning.search import PlanRequest

REQUEST_FIELDS = frozenset(f.name for f in fields(PlanRequest)) - {"config"}


def plan_request(cfg: TrainConfig | None = None, **kw) -> PlanRequest:
    """A request whose config is `cfg` (default: the defaults on a CUDA device, which a plan is made for) with
    the settings among `kw`; the rest of `kw` are the request's own fields (resident_layers, budget, ...).
    The planner takes a model's shapes from its Geometry, so the default config's model name is never read."""
    own = {k: kw.pop(k) for k in REQUEST_FIELDS & kw.keys()}
    return PlanRequest((cfg or TrainConfig(model="planned", device="cuda")).replace(**kw), **own)
