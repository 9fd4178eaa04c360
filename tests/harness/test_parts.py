"""A run in parts (--max-minutes, then --resume) spends its time on timed passes: a warm-up starts only
where a pass will follow it, a warm-up's compiling first steps do not set the pace a pass is judged by, and
Unsloth's child reports every pass as it ends and stops at the budget."""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import pytest

import poros.engine.unsloth as um
from poros.config import TrainConfig
from poros.harness import bench
from poros.harness.bench import OutOfTime, measure


class SlowStart:
    """A trainer whose steps take `step_s`, the first `first_s` (a compiled layer's first step)."""

    def __init__(self, step_s: float, first_s: float | None = None):
        self.step_s, self.first_s, self.steps = step_s, first_s, 0

    def step(self):
        time.sleep(self.first_s if self.steps == 0 and self.first_s is not None else self.step_s)
        self.steps += 1
        return SimpleNamespace(loss=1.0, counters={})


CPU = TrainConfig(model="tiny-qwen2", device="cpu")


def test_no_warm_up_starts_where_an_earlier_pass_says_the_next_pass_would_not_fit():
    trainer = SlowStart(0.01)
    earlier = [{"seconds": 4 * 0.5}]  # 0.5 s a step in the earlier part: warm-up + pass take 3 s
    with pytest.raises(OutOfTime, match="warm-up and the next pass"):
        measure(trainer, CPU, 4, 2, 1, warmup_steps=2, earlier=earlier, deadline=time.monotonic() + 2.0)
    assert trainer.steps == 0, "the warm-up must not run"
    # negative control: with room for it, the warm-up and the remaining pass run
    out = measure(trainer, CPU, 4, 2, 1, warmup_steps=2, earlier=earlier, deadline=time.monotonic() + 60)
    assert trainer.steps == 2 + 4 and len(out.per_pass_s) == 2


def test_a_warm_up_s_compiling_first_step_does_not_set_the_pace_of_the_pass():
    """4 warm-up steps, the first 0.6 s (compiling), then 0.01 s each: the pass of 10 steps fits in 0.5 s
    and runs; judged by the warm-up's mean (0.16 s a step) it would have been refused."""
    trainer = SlowStart(0.01, first_s=0.6)
    out = measure(trainer, CPU, 10, 1, 1, warmup_steps=4, deadline=time.monotonic() + 0.6 + 0.04 + 0.5)
    assert len(out.per_pass_s) == 1
    # negative control: a pass that does not fit after its warm-up is refused
    trainer = SlowStart(0.05, first_s=0.6)
    with pytest.raises(OutOfTime):
        measure(trainer, CPU, 10, 1, 1, warmup_steps=4, deadline=time.monotonic() + 0.6 + 0.2 + 0.3)
    assert trainer.steps == 4


def test_phases_add_up_what_a_run_spent_where():
    bench.reset_phases()
    measure(SlowStart(0.01), CPU, 3, 2, 1, warmup_steps=2)
    times = bench.phase_times()
    assert set(times) == {"warm-up", "timed passes"}
    assert times["timed passes"] >= 6 * 0.01 and times["warm-up"] >= 2 * 0.01


class Child:
    """The child process's stand-in: prints `lines`, remembers its command."""

    def __init__(self, cmd, lines):
        self.cmd, self.stdout, self.returncode = cmd, io.StringIO("".join(x + "\n" for x in lines)), 0

    def poll(self):
        return 0

    def wait(self):
        return 0


@pytest.fixture
def child(monkeypatch):
    exports = []
    monkeypatch.setattr(um, "unavailable", lambda device: None)
    monkeypatch.setattr(um, "store_fingerprint", lambda store: store)
    monkeypatch.setattr(um, "export_bnb4bit", lambda store, folder: (exports.append(store),
                                                                       folder.mkdir(parents=True, exist_ok=True)))
    started = []

    def set_lines(lines):
        def popen(cmd, **kw):
            started.append(Child(cmd, lines))
            return started[-1]
        monkeypatch.setattr(um.subprocess, "Popen", popen)

    return SimpleNamespace(set=set_lines, started=started, exports=exports)


def _pass(seconds):
    return um.PASS + json.dumps({"seconds": seconds, "alloc_retries": 0, "peak_vram_gb": 1.0})


def test_the_child_reports_each_pass_as_it_ends_and_gets_the_warm_up_steps_and_budget(child, tmp_path):
    child.set([_pass(2.0), "  unsloth: the next pass would end past the time budget",
               um.RESULT + json.dumps({"per_pass_s": [2.0], "stopped": "time budget"})])
    seen = []
    cfg = TrainConfig(model="tiny-qwen3", device="cuda")
    record = um.measure_unsloth("A", cfg, 200, 3, 1, workdir=str(tmp_path), log=lambda x: None,
                                warmup_steps=20, on_pass=seen.append, budget_s=300.0)
    assert [r["seconds"] for r in seen] == [2.0] and record["stopped"] == "time budget"
    cmd = child.started[-1].cmd
    assert cmd[cmd.index("--warmup-steps") + 1] == "20" and cmd[cmd.index("--budget-s") + 1] == "300.0"


def test_a_kept_export_serves_the_next_child_of_the_same_store_only(child, tmp_path):
    child.set([um.RESULT + json.dumps({"per_pass_s": [1.0]})])
    cfg = TrainConfig(model="tiny-qwen3", device="cuda")
    run = lambda store, keep=True: um.measure_unsloth(store, cfg, 2, 1, 1, workdir=str(tmp_path),  # noqa: E731
                                                      log=lambda x: None, keep_export=keep)
    run("A")
    run("A")
    assert child.exports == ["A"], "the second child of store A loads the kept export"
    run("B")
    assert child.exports == ["A", "B"]
    assert [p.name for p in tmp_path.glob(um.EXPORT_PREFIX + "*")] == [um.EXPORT_PREFIX + "B"], \
        "one kept export at a time"
    run("C", keep=False)  # negative control: not kept, exported for its child and removed
    assert child.exports == ["A", "B", "C"] and not list(tmp_path.glob("poros-unsloth-[!e]*"))
    um.remove_kept_exports(str(tmp_path))
    assert not list(tmp_path.glob(um.EXPORT_PREFIX + "*"))


def test_the_store_fingerprint_names_the_weights():
    from poros.store.build import build_store

    plain, _ = build_store("tiny-qwen3", device="cpu", progress=None)
    again, _ = build_store("tiny-qwen3", device="cpu", progress=None)
    assert um.store_fingerprint(plain) == um.store_fingerprint(again)
    nested, _ = build_store("tiny-qwen3", device="cpu", progress=None, double_quant=True)
    assert um.store_fingerprint(nested) != um.store_fingerprint(plain)
    plain.arena[plain.layers[-1].end - 1] ^= 1  # one byte of the last layer differs
    assert um.store_fingerprint(plain) != um.store_fingerprint(again)
