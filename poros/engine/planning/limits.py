"""How far a run's settings reach: the smallest VRAM budget for which the planner finds a plan, and the longest
sequence length whose plan fits a budget (`poros plan --smallest-budget`, `--longest-seq-len`).

Both ask the planner's own search (`search_budget`, with its memory model) at values on a grid (budgets in steps
of bytes, lengths in steps of tokens): a doubling ladder across the range, then bisection between the last value
on one side of the edge and the first on the other. Bisection presumes the fit monotone (more budget, or fewer
tokens, never loses a plan); the ladder runs past the edge so that the presumption is checked, not assumed, at
every value asked: a value that fits beyond one that does not is named (`Limit.out_of_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from poros.engine.planning.geometry import Geometry
from poros.engine.planning.plan import Plan
from poros.engine.planning.budget import refusal, search_budget
from poros.engine.planning.search import PlanRequest
from poros.errors import BudgetError, ConfigError
from poros.sizes import format_size

BUDGET_STEP = 10**8  # 0.1 GB: the precision of the smallest budget a refused plan names
SEQ_LEN_STEP = 1024
BUDGET_CAP = 2**50  # the ladder of budgets ends here at the latest (no device holds a petabyte)

Fit = Callable[[int], "Plan | None"]  # a value (bytes or tokens) to the plan the search finds there, or None


@dataclass(frozen=True)
class Limit:
    """Where the fit ends on a grid of `step`: `value` (the smallest budget in bytes, or the longest sequence in
    tokens) and `plan`, the plan there. `tried`: every value asked, ascending, with whether a plan fit;
    `out_of_order`: pairs (a value that fits, one that does not) the wrong way round for a monotone fit;
    `at_top`: the value is the top of its range, where nothing beyond was asked."""

    value: int
    plan: Plan
    step: int
    tried: tuple[tuple[int, bool], ...]
    out_of_order: tuple[tuple[int, int], ...] = ()
    at_top: bool = False

    @property
    def monotone(self) -> bool:
        """Whether the fit was monotone at every value asked."""
        return not self.out_of_order


class _Asked:
    """`fit` at multiples of `step`, each asked once, every answer kept."""

    def __init__(self, fit: Fit, step: int):
        self.fit, self.step, self.plans = fit, step, {}

    def __call__(self, k: int) -> Plan | None:
        if k not in self.plans:
            self.plans[k] = self.fit(k * self.step)
        return self.plans[k]

    def tried(self) -> tuple[tuple[int, bool], ...]:
        return tuple((k * self.step, p is not None) for k, p in sorted(self.plans.items()))


def out_of_order(tried, rising: bool) -> tuple[tuple[int, int], ...]:
    """(fits, does not) pairs among `tried` against a monotone fit: with `rising` (a larger value fits where a
    smaller one does) each value that does not fit above the smallest that does; else each value that fits above
    the smallest that does not."""
    if rising:
        fits = [v for v, ok in tried if ok]
        return tuple((fits[0], v) for v, ok in tried if fits and not ok and v > fits[0])
    fails = [v for v, ok in tried if not ok]
    return tuple((v, fails[0]) for v, ok in tried if fails and ok and v > fails[0])


def lowest_fit(fit: Fit, step: int, enough: Callable[[Plan], bool], cap: int) -> Limit | None:
    """The smallest multiple of `step` at which `fit` gives a plan: 0, then doubling from `step` until a plan
    that `enough` says more cannot change (or past `cap`), then bisection below the first value that fits.
    None when nothing up to `cap` fits."""
    ask, k, first = _Asked(fit, step), 1, None
    ask(0)
    while k * step <= cap:
        plan = ask(k)
        if plan is not None:
            first = first or k
            if enough(plan):
                break
        k *= 2
    if first is None:
        return None
    lo, hi = first // 2, first  # asked: 0 or the ladder's step before
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ask(mid) is not None else (mid, hi)
    tried = ask.tried()
    return Limit(hi * step, ask.plans[hi], step, tried, out_of_order(tried, rising=True))


def highest_fit(fit: Fit, step: int, top: int) -> Limit | None:
    """The largest multiple of `step` up to `top` at which `fit` gives a plan: doubling from `step` across the
    whole range (and its top), then bisection above the last value of the ladder that fits before the first
    that does not. None when `step` itself does not fit."""
    ask, top_k = _Asked(fit, step), top // step
    if top_k < 1 or ask(1) is None:
        return None
    ladder = sorted({*(2**i for i in range(top_k.bit_length())), top_k})
    fails = [k for k in ladder if ask(k) is None]
    if not fails:
        tried = ask.tried()
        return Limit(top_k * step, ask.plans[top_k], step, tried, out_of_order(tried, rising=False), at_top=True)
    hi = fails[0]
    lo = max(k for k in ladder if k < hi)  # every rung below the first that fails fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ask(mid) is not None else (lo, mid)
    tried = ask.tried()
    return Limit(lo * step, ask.plans[lo], step, tried, out_of_order(tried, rising=False))


def everything_resident(plan: Plan) -> bool:
    """A plan that more budget cannot change: every layer and the lm_head on the device."""
    return not plan.streamed_layers and plan.head_resident


def smallest_budget(geo: Geometry, request: PlanRequest, step: int = BUDGET_STEP) -> Limit:
    """The smallest budget, a multiple of `step` bytes, for which the planner finds a plan on `request`'s
    settings (its own budget is not read).

    Raises:
        BudgetError: no budget up to BUDGET_CAP holds a plan.
    """
    limit = lowest_fit(lambda b: search_budget(geo, replace(request, budget=b))[0], step, everything_resident,
                       BUDGET_CAP)
    if limit is None:
        raise BudgetError(f"no plan for {geo.name} fits any budget up to {format_size(BUDGET_CAP)}")
    return limit


def at_seq_len(request: PlanRequest, seq_len: int) -> PlanRequest:
    """`request` with its config at `seq_len` tokens a sequence."""
    return replace(request, config=request.config.replace(seq_len=seq_len))


def longest_seq_len(geo: Geometry, request: PlanRequest, top: int, step: int = SEQ_LEN_STEP) -> Limit:
    """The longest sequence length, a multiple of `step` tokens up to `top` (the model's longest), whose plan
    fits `request.budget` (`request.config.seq_len` is not read).

    Raises:
        ConfigError: `request` has no budget, or `step` exceeds `top`.
        BudgetError: no plan fits the budget at `step` tokens; names the smallest budget that would.
    """
    if request.budget is None:
        raise ConfigError(["vram_budget: the longest sequence length is the longest whose plan fits a budget; "
                           "give one, e.g. --vram-budget 24GB"])
    if step > top:
        raise ConfigError([f"seq_len_step: {step} is longer than the longest sequence {geo.name} takes ({top}, its "
                           f"max_position_embeddings); use a step of at most {top}"])
    limit = highest_fit(lambda n: search_budget(geo, at_seq_len(request, n))[0], step, top)
    if limit is None:
        _, seen = search_budget(geo, at_seq_len(request, step))
        raise BudgetError("no sequence length fits: " + refusal(geo, request, seen, at=f" at {step} tokens",
                                                                 shorter="a smaller --seq-len-step"))
    return limit
