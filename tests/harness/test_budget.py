"""A time budget is a promise (poros/harness/budget.py): a pass or gate that cannot end within `--max-minutes` is
not started, or is stopped once its own steps show it cannot end, and one that could not end within a whole budget
says so (`never`), since running the part again would not get further. The passes and the gate run the real
trainers: every optimizer step of the engine reports to the budget (`poros.engine.methods.trainer.after_each_step`)."""

from __future__ import annotations

import time

import pytest

from poros.config import Method, TrainConfig
from poros.harness.budget import OutOfTime, TimeBudget
from poros.harness.timing import measure
from tests.suite_runs import TINY, result_rows, run_suite, why

CFG = TrainConfig(model="tiny-qwen2", device="cpu", seq_len=64, lora_rank=4, lora_alpha=8, block_size=2)


@pytest.fixture(scope="module")
def store():
    from poros.store.build import build_store

    return build_store("tiny-qwen2", device="cpu", progress=False)[0]


def test_a_pass_or_gate_is_judged_before_it_starts():
    budget = TimeBudget.seconds_from_now(10)
    budget.check("a pass", 5)  # fits
    budget.check("a pass", None)  # not known yet: it starts, and its steps are watched
    with pytest.raises(OutOfTime) as e:
        budget.check("a pass", 9.99, margin=1.2)
    assert not e.value.never and "a pass would take about" in str(e.value)
    with pytest.raises(OutOfTime) as e:
        budget.check("a pass", 11, lower="parity_steps")
    assert e.value.never and "a pass cannot end within --max-minutes 0.166667 (10 s): it takes at least 11 s" \
        in str(e.value)
    assert "lower parity_steps or raise --max-minutes" in str(e.value)
    with pytest.raises(OutOfTime, match="the budget is spent"):
        TimeBudget(1e-9).check("a pass", None)


def test_a_pass_that_can_never_end_within_the_budget_stops_after_its_second_step(store):
    from poros.engine.methods.registry import make_trainer

    trainer = make_trainer(Method.RESIDENT, store, CFG)
    try:
        t0 = time.monotonic()
        with pytest.raises(OutOfTime) as e:
            measure(trainer, CFG, 10**12, 2, 1, label="resident", budget=TimeBudget.seconds_from_now(120))
        assert e.value.never, e.value
        assert str(e.value).startswith("resident warm-up (1000000000000 steps at ") and \
            "cannot end within --max-minutes 2 (120 s): it takes at least " in str(e.value), e.value
        assert trainer.steps_done == 2 and time.monotonic() - t0 < 120, "stopped once its pace was known"
        # negative control: passes that fit in the same budget run to their end
        out = measure(trainer, CFG, 3, 2, 1, label="resident", budget=TimeBudget.seconds_from_now(120))
        assert len(out.per_pass_s) == 2 and trainer.steps_done == 2 + 3 + 6
    finally:
        trainer.close()


class Clock:
    """time.monotonic as the budget reads it, moved by the test: no assertion depends on how fast this machine is."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pass_is_stopped_where_its_remaining_steps_cannot_end_before_the_deadline(monkeypatch):
    """Steps of 1 s on the budget's clock: a pass of 100 fits a whole budget of 150 s (not `never`), but started
    with 30 s left it is stopped at its second step, once its pace is known; with the budget untouched (the control)
    all 100 run. The steps report as the engine's do (`after_each_step`'s hook)."""
    import poros.engine.methods.trainer as engine
    import poros.harness.budget as B

    clock = Clock()
    monkeypatch.setattr(B.time, "monotonic", clock)

    def run_pass(budget, steps=100) -> int:
        done = 0
        with budget.watch("a pass", steps):
            for _ in range(steps):
                clock.now += 1.0
                done += 1
                engine._after_step()  # what Trainer.optimizer_step calls
        return done

    budget = TimeBudget.seconds_from_now(150)
    clock.now += 120  # the part spent 120 s before this pass
    with pytest.raises(OutOfTime) as e:
        run_pass(budget)
    assert not e.value.never and str(e.value).startswith("a pass was stopped after 2 of 100 steps: the other 98"), \
        e.value
    assert clock.now == 1000.0 + 120 + 2
    assert run_pass(TimeBudget.seconds_from_now(150)) == 100  # control
    with pytest.raises(OutOfTime) as e:  # a whole budget too short for it: never
        run_pass(TimeBudget.seconds_from_now(50))
    assert e.value.never and clock.now == 1000.0 + 120 + 2 + 100 + 2
    assert engine._after_step is None, "the hook is removed after the pass"


def test_a_gate_of_a_billion_steps_is_stopped_and_one_that_fits_runs(store):
    from poros.engine.verify.parity import parity

    budget = TimeBudget.seconds_from_now(120)
    t0 = time.monotonic()
    with pytest.raises(OutOfTime) as e:
        with budget.watch("the parity gate", 2 * 10**9, "parity_steps"):
            parity(CFG, steps=10**9, store=store)
    assert e.value.never and "lower parity_steps" in str(e.value), e.value
    assert time.monotonic() - t0 < 120
    with budget.watch("the parity gate", 2 * 2, "parity_steps"):  # negative control: two steps a side
        assert parity(CFG, steps=2, store=store).ok


def test_a_budget_spent_before_anything_ran_exits_without_the_retry_status_and_records_the_part(tmp_path):
    """`--max-minutes 1e-09 --resume`: nothing can run; exit 75 would ask for the same part again, which would get
    no further, so the run exits 1 saying so, and its part is recorded (poros bench status shows it)."""
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"], "parity_steps": 1}
    proc, results = run_suite(tmp_path, matrix, "--max-minutes=1e-09", "--resume")
    assert proc.returncode == 1, why(proc)
    assert "before a pass, gate or row was recorded: a part this short makes no progress; raise --max-minutes" \
        in proc.stdout, why(proc)
    parts = [r for r in result_rows(results.with_name("passes.jsonl")) if r["kind"] == "part"]
    assert len(parts) == 1 and parts[0]["stopped"] and parts[0]["max_minutes"] == 1e-09
    assert not results.exists() or not results.read_text()


@pytest.mark.slow  # the suites end to end in a subprocess
@pytest.mark.parametrize("changes, flags, failing", [
    ({"steps": 10**12}, [], ["method:poros", "method:resident"]),
    ({}, ["--parity-steps=1000000000"], ["gate:parity", "method:poros", "method:resident"]),
], ids=["steps=1e12", "parity-steps=1e9"])
def test_a_run_whose_pass_or_gate_can_never_end_within_the_budget_ends_in_time_naming_it(tmp_path, changes, flags,
                                                                                          failing):
    """The run ends well within `--max-minutes 0.5` (it used to run on forever), each cell the pass or gate belongs
    to fails in one line naming what to change, and the gate that cannot end runs once, not once per cell; the
    control, the same matrix with steps that fit, ends 0."""
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"], "parity_steps": 1, **changes}
    t0 = time.monotonic()
    proc, _ = run_suite(tmp_path, matrix, "--max-minutes=0.5", *flags)
    assert proc.returncode == 1, why(proc)
    assert time.monotonic() - t0 < 200, "the run ended at the budget, not after it"
    assert f"{len(failing)} failed" in proc.stdout.splitlines()[-1], why(proc)
    assert all(any(x.startswith("FAILED ") and cell in x for x in proc.stdout.splitlines()) for cell in failing)
    said = [x for x in proc.stdout.splitlines() if "cannot end within --max-minutes 0.5 (30 s): it takes at least" in x]
    assert len(said) >= len(failing) and "During handling" not in proc.stdout, why(proc)
    (tmp_path / "control").mkdir()
    control, _ = run_suite(tmp_path / "control", {**matrix, "steps": 2}, "--max-minutes=10")
    assert control.returncode == 0, why(control)
