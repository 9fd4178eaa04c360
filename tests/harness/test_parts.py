"""A run in parts (--max-minutes, then --resume) spends its time on timed passes: a warm-up starts only
where a pass will follow it, a warm-up's compiling first steps do not set the pace a pass is judged by, and
Unsloth's child reports every pass as it ends and stops at the budget."""

from __future__ import annotations

import io
import json
import time
from types import SimpleNamespace

import pytest

import poros.harness.unsloth as um
from poros.config import TrainConfig
from poros.harness import console
from poros.harness.budget import TimeBudget
from poros.harness.timing import OutOfTime, measure


class SlowStart:
    """A trainer whose steps take `step_s`, the first `first_s` (a compiled layer's first step)."""

    def __init__(self, step_s: float, first_s: float | None = None):
        self.step_s, self.first_s, self.steps = step_s, first_s, 0

    def step(self):
        time.sleep(self.first_s if self.steps == 0 and self.first_s is not None else self.step_s)
        self.steps += 1
        return SimpleNamespace(loss=1.0, counters={})


CPU = TrainConfig(model="tiny-qwen2", device="cpu")
GATE_PASS = {"parity": "PASS", "steps": 3, "tensors_compared": 10, "first_mismatch": None, "max_abs_diff": 0.0}


def test_no_warm_up_starts_where_an_earlier_pass_says_the_next_pass_would_not_fit():
    trainer = SlowStart(0.01)
    earlier = [{"seconds": 4 * 0.5}]  # 0.5 s a step in the earlier part: warm-up + pass take 3 s
    with pytest.raises(OutOfTime, match="warm-up and the next pass"):
        measure(trainer, CPU, 4, 2, 1, warmup_steps=2, earlier=earlier, budget=TimeBudget.seconds_from_now(2.0))
    assert trainer.steps == 0, "the warm-up must not run"
    # negative control: with room for it, the warm-up and the remaining pass run
    out = measure(trainer, CPU, 4, 2, 1, warmup_steps=2, earlier=earlier, budget=TimeBudget.seconds_from_now(60))
    assert trainer.steps == 2 + 4 and len(out.per_pass_s) == 2


def test_stop_after_times_that_many_passes_after_the_earlier_ones():
    """`stop_after` (--passes-per-part): a process times at most that many of the passes left, after its own warm-up;
    the passes an earlier process timed come first. Control: without it every pass left is timed."""
    trainer = SlowStart(0.001)
    out = measure(trainer, CPU, 3, 3, 1, warmup_steps=2, earlier=[{"seconds": 0.5}], stop_after=1)
    assert out.per_pass_s[0] == 0.5 and len(out.per_pass_s) == 2 and trainer.steps == 2 + 3
    trainer = SlowStart(0.001)
    assert len(measure(trainer, CPU, 3, 3, 1, warmup_steps=2, earlier=[{"seconds": 0.5}]).per_pass_s) == 3
    assert trainer.steps == 2 + 2 * 3


def test_a_warm_up_s_compiling_first_step_does_not_set_the_pace_of_the_pass():
    """4 warm-up steps, the first 0.6 s (compiling), then 0.01 s each: the pass of 10 steps fits in 0.5 s
    and runs; judged by the warm-up's mean (0.16 s a step) it would have been refused."""
    trainer = SlowStart(0.01, first_s=0.6)
    out = measure(trainer, CPU, 10, 1, 1, warmup_steps=4, budget=TimeBudget.seconds_from_now(0.6 + 0.04 + 0.5))
    assert len(out.per_pass_s) == 1
    # negative control: a pass that does not fit after its warm-up is refused
    trainer = SlowStart(0.05, first_s=0.6)
    with pytest.raises(OutOfTime):
        measure(trainer, CPU, 10, 1, 1, warmup_steps=4, budget=TimeBudget.seconds_from_now(0.6 + 0.2 + 0.3))
    assert trainer.steps == 4


def test_phases_add_up_what_a_run_spent_where():
    console.reset_phases()
    measure(SlowStart(0.01), CPU, 3, 2, 1, warmup_steps=2)
    times = console.phase_times()
    assert set(times) == {"warm-up", "timed passes"}
    assert times["timed passes"] >= 6 * 0.01 and times["warm-up"] >= 2 * 0.01


def test_a_phase_line_records_host_memory(monkeypatch):
    """Each phase's log line carries what /proc said of host memory as it ended (a run the system ends for want of
    memory leaves the figures in its log); where /proc says nothing, the line is the time alone."""
    import poros.store.host_memory as H

    lines = []
    console.set_progress_writer(lines.append)
    try:
        monkeypatch.setattr(H, "available_host_memory", lambda: 38_200_000_000)
        monkeypatch.setattr(H, "process_host_memory", lambda: 86_400_000_000)
        with console.phase("trainer set-up"):
            pass
        monkeypatch.setattr(H, "available_host_memory", lambda: None)
        monkeypatch.setattr(H, "process_host_memory", lambda: None)
        with console.phase("warm-up"):
            pass
    finally:
        console.set_progress_writer(None)
    assert lines[0].endswith("s (host: 38.2 GB available, 86.4 GB held by this process)"), lines
    assert lines[1].startswith("  time: warm-up ") and lines[1].endswith(" s"), lines


class Child:
    """The child process's stand-in: prints `lines`, remembers its command."""

    def __init__(self, cmd, lines):
        self.cmd, self.stdout, self.returncode = cmd, io.StringIO("".join(x + "\n" for x in lines)), 0

    def poll(self):
        return 0

    def wait(self):
        return 0

    def kill(self):
        pass


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


def _warm(pace):
    return um.WARM + json.dumps({"seconds": 1.0, "pace": pace})


def _pass(seconds):
    return um.PASS + json.dumps({"seconds": seconds, "alloc_retries": 0, "peak_vram_gb": 1.0})


CUDA = TrainConfig(model="tiny-qwen3", device="cuda")


def test_each_child_pass_is_kept_as_it_ends_and_the_child_gets_the_warm_up_steps(child, tmp_path):
    child.set([_warm(0.001), _pass(2.0), _pass(2.1), um.RESULT + json.dumps({"per_pass_s": [2.0, 2.1]})])
    seen = []
    record = um.measure_unsloth("A", CUDA, 200, 3, 1, workdir=str(tmp_path), log=lambda x: None,
                                warmup_steps=20, on_pass=seen.append, earlier=[{"seconds": 1.9}])
    assert [r["child_seconds"] for r in seen] == [2.0, 2.1] and len(record["per_pass_s"]) == 2
    cmd = child.started[-1].cmd
    assert cmd[cmd.index("--warmup-steps") + 1] == "20"
    assert cmd[cmd.index("--passes") + 1] == "2", "the earlier pass is not run again"


def test_a_child_pass_that_would_end_past_the_budget_is_not_waited_for(child, tmp_path):
    """The warm-up's pace (1 s a step) says a 200-step pass would take 200 s: with 60 s left, the parent stops
    the child after the warm-up, and the pass before it is kept."""
    child.set([_warm(1.0), _pass(2.0), _pass(2.1), um.RESULT + json.dumps({"per_pass_s": [2.0, 2.1]})])
    seen = []
    with pytest.raises(OutOfTime):
        um.measure_unsloth("A", CUDA, 200, 2, 1, workdir=str(tmp_path), log=lambda x: None, on_pass=seen.append,
                           budget=TimeBudget.seconds_from_now(60))
    assert seen == []
    # negative control: the same child with time to spare runs its passes
    child.set([_warm(1.0), _pass(2.0), _pass(2.1), um.RESULT + json.dumps({"per_pass_s": [2.0, 2.1]})])
    um.measure_unsloth("A", CUDA, 200, 2, 1, workdir=str(tmp_path), log=lambda x: None, on_pass=seen.append,
                       budget=TimeBudget.seconds_from_now(1000))
    assert len(seen) == 2


def test_a_kept_export_serves_the_next_child_of_the_same_store_only(child, tmp_path):
    lines = [_warm(0.001), _pass(1.0), um.RESULT + json.dumps({"per_pass_s": [1.0]})]
    run = lambda store, keep=True: (child.set(lines), um.measure_unsloth(  # noqa: E731
        store, CUDA, 2, 1, 1, workdir=str(tmp_path), log=lambda x: None, keep_export=keep))
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


def test_the_committed_run_in_parts_says_where_it_stands():
    """results/h200/README.md carries `poros bench status` of its own rows, as the rows now are, against the matrix
    the run ran (the run's folder keeps it as matrix.yaml)."""
    from pathlib import Path

    from poros.harness.matrix import load_matrix
    from poros.harness.progress import status_markdown

    root = Path(__file__).resolve().parents[2]
    readme = (root / "results/h200/README.md").read_text()
    status = status_markdown(load_matrix(str(root / "results/h200/matrix.yaml")), root / "results/h200")
    assert readme.endswith("## Cells and parts\n\n" + status)


def _status_matrix(**change):
    from poros.harness.matrix import parse_matrix

    return parse_matrix(dict(dict(name="t", steps=4, passes=2, warmup_passes=1, seq_len=64, batch_size=1, grad_accum=1,
                                  lora_rank=4, lora_alpha=8, block_size=2, dataset="synthetic", device="cpu",
                                  stacks=["current"], methods=["poros", "resident"], models=["tiny-qwen2"]), **change),
                        "t.yaml")


def test_status_reads_gates_passes_and_rows(tmp_path):
    from poros.harness.cells import cell_config, cell_fingerprint, gate_fingerprint, matrix_cells
    from poros.harness.result_row import record
    from poros.harness.progress import cell_states, status_markdown
    from poros.harness.results import PassLog, ResultsWriter

    m = _status_matrix()
    gate, resident, poros = matrix_cells(m)
    log = PassLog(tmp_path / "passes.jsonl")
    log.add("gate", gate.id + "/None", gate_fingerprint(m, gate, None, m.parity_steps), result=GATE_PASS)
    log.add("pass", resident.id, cell_fingerprint(m, resident), index=0, seconds=1.0, gpu="GPU-c")
    log.add("pass", resident.id, "another-fingerprint", index=1, seconds=1.0)  # another run's: not counted
    row = record(m, poros, cell_config(m, poros), None, None, reduced=False)
    ResultsWriter(tmp_path / "results.jsonl").append({**row, "s_per_step_median": 0.5, "per_pass_s": [2.0, 2.0]})
    assert cell_states(m, tmp_path) == [("tiny-qwen2 gate", "PASS (3 steps)"),
                                        ("tiny-qwen2 resident", "1 of 2 passes on c"),
                                        ("tiny-qwen2 poros", "done: 0.5000 s/step over 2 passes")]
    log.add("part", "", "", started=0.0, wall_s=10.0, phases={"timed passes": 4.0, "warm-up": 6.0}, exit_status=75,
            gpu=["GPU-12345678-aa"])
    md = status_markdown(m, tmp_path)
    assert "| 1 | 1970-01-01 00:00 | 10 s | 4 s | warm-up 6 s | 75 | 12345678 |" in md
    assert "1 of 2 timed cells done (4 steps x 2 passes each)" in md
    ResultsWriter(tmp_path / "results.jsonl").append({**row, "s_per_step_median": 0.5, "per_pass_s": [2.0, 2.0],
                                                      "pass_gpus": ["GPU-a", "GPU-b"]})
    assert cell_states(m, tmp_path)[2] == ("tiny-qwen2 poros", "done: 0.5000 s/step over 2 passes on a, b")
    assert "The timed cells ran on 3 GPUs (a, b, c): a ratio between cells of different GPUs" in status_markdown(m, tmp_path)


def test_status_counts_gpus_and_processes_from_the_passes(tmp_path):
    """Each pass record names its GPU and process: a cell whose passes ran on two GPUs is said to, whatever the GPU
    of the process that wrote its row. Negative control: one GPU and one process say nothing of either."""
    from poros.harness.cells import cell_config, cell_fingerprint, matrix_cells
    from poros.harness.progress import cell_states, status_markdown
    from poros.harness.result_row import record
    from poros.harness.results import PassLog, ResultsWriter

    m = _status_matrix(methods=["resident"])
    (resident,) = matrix_cells(m)
    fp = cell_fingerprint(m, resident)
    one = PassLog(tmp_path / "passes.jsonl", process={"host": "h", "pid": 7, "started": 1.0})
    one.add("pass", resident.id, fp, index=0, seconds=1.0, gpu="GPU-aaaa")
    row = record(m, resident, cell_config(m, resident), None, None, reduced=False)
    ResultsWriter(tmp_path / "results.jsonl").append({**row, "s_per_step_median": 0.5, "per_pass_s": [1.0, 1.0],
                                                      "pass_gpus": ["GPU-bbbb", "GPU-bbbb"]})
    one.add("pass", resident.id, fp, index=1, seconds=1.0, gpu="GPU-aaaa")
    md = status_markdown(m, tmp_path)
    assert cell_states(m, tmp_path)[0][1].endswith("on aaaa") and "GPUs" not in md and "processes" not in md, md
    other = PassLog(tmp_path / "passes.jsonl", process={"host": "h2", "pid": 7, "started": 2.0})
    (tmp_path / "passes.jsonl").write_text((tmp_path / "passes.jsonl").read_text().splitlines(True)[0])
    other.add("pass", resident.id, fp, index=1, seconds=1.0, gpu="GPU-cccc")
    md = status_markdown(m, tmp_path)
    assert "The timed cells ran on 2 GPUs (aaaa, cccc)" in md and "Their passes ran in 2 processes." in md, md


def test_status_holds_every_record_to_the_matrix(tmp_path):
    """What `poros bench status` once said falsely: passes past the cell's count ("4 of 2 passes"), rows of another
    matrix or another seq_len read as done, a FAIL cell read as done, a kept reference side as "not run", unsloth on a
    CPU as "not started". Each control: the record as this matrix's run writes it."""
    from poros.errors import PorosError
    from poros.harness.cells import (cell_config, cell_fingerprint, gate_config, matrix_cells,
                                     reference_fingerprint)
    from poros.config import Method
    from poros.harness.progress import cell_states, status_markdown
    from poros.harness.result_row import record
    from poros.harness.results import PassLog, ResultsWriter

    m = _status_matrix(methods=["poros", "resident_gc", "unsloth"])
    gate, gc, poros, unsloth = matrix_cells(m)
    log = PassLog(tmp_path / "passes.jsonl")
    fp = cell_fingerprint(m, gc)
    for i in (0, 1, 2, 3):  # a run of 4 passes in a folder this 2-pass matrix is asked about
        log.add("pass", gc.id, fp, index=i, seconds=1.0)
    states = dict(cell_states(m, tmp_path))
    assert states["tiny-qwen2 resident_gc"] == "2 of 2 passes"
    assert "pass index 2 is beyond the cell's 2 passes" in status_markdown(m, tmp_path)
    assert states["tiny-qwen2 unsloth"] == "cannot run on cpu: unsloth needs a CUDA GPU (it cannot even be imported without one)"
    assert states["tiny-qwen2 poros"] == "not started"  # control: a cell that can run
    assert states["tiny-qwen2 gate"] == "not run"
    cfg = gate_config(m, gate, None)
    log.add("reference", gate.id + "/reference", reference_fingerprint(m, cfg, m.parity_steps, Method.RESIDENT_GC),
            file="x.json.gz", seconds=12.0)
    assert dict(cell_states(m, tmp_path))["tiny-qwen2 gate"] == \
        "resident_gc's side kept (12 s, x.json.gz); poros's side not run yet"

    results = ResultsWriter(tmp_path / "results.jsonl")
    row = {**record(m, poros, cell_config(m, poros), None, None, reduced=False), "s_per_step_median": 0.23,
           "per_pass_s": [1.0, 1.0], "parity": "FAIL", "parity_first_mismatch": "step0.grad:x", "gate": "resident_gc"}
    results.append(row)
    states = dict(cell_states(m, tmp_path))
    assert states["tiny-qwen2 poros"] == "parity FAIL (first mismatch step0.grad:x): not done; --resume gates it again"
    assert states["tiny-qwen2 gate"].startswith("FAIL (first mismatch step0.grad:x)")
    assert status_markdown(m, tmp_path).startswith("0 of 3 timed cells done (4 steps x 2 passes each); 1 cannot run on cpu.")
    results.append({**row, "parity": "PASS", "parity_first_mismatch": None})  # control
    assert dict(cell_states(m, tmp_path))["tiny-qwen2 poros"].startswith("done: 0.2300 s/step")
    results.append({**row, "parity": "PASS", "config": {**row["config"], "seq_len": 128}})
    assert dict(cell_states(m, tmp_path))["tiny-qwen2 poros"] == \
        "rows of other settings (seq_len 128, the matrix 64): not this matrix's cell"
    results.append({**row, "matrix": "other"})
    with pytest.raises(PorosError, match="holds rows of matrix 'other', not 't': pass the matrix file that run measured"):
        cell_states(m, tmp_path)


def test_a_part_is_its_last_record_and_one_without_an_end_says_so(tmp_path):
    """A part's records (at its first cell, after each cell, at its end) share its id and count once, as the
    last; a part whose machine was lost has no exit status; records without an id are parts of their own."""
    from poros.harness.progress import parts, status_markdown
    from poros.harness.matrix import parse_matrix
    from poros.harness.results import PassLog

    m = parse_matrix(dict(name="t", steps=4, passes=2, warmup_passes=1, seq_len=64, batch_size=1, grad_accum=1,
                          lora_rank=4, lora_alpha=8, block_size=2, dataset="synthetic", device="cpu",
                          stacks=["current"], methods=["resident"], models=["tiny-qwen2"]), "t.yaml")
    log = PassLog(tmp_path / "passes.jsonl")
    log.add("part", "", "", started=0.0, wall_s=5.0, phases={}, exit_status=75, gpu=[])  # no id
    for wall, status in ((1.0, None), (7.0, None), (9.0, 75)):
        log.add("part", "", "", part_id="a", started=60.0, wall_s=wall, phases={"timed passes": wall}, exit_status=status,
                gpu=["GPU-aaaaaaaa-1"])
    for wall in (1.0, 30.0):
        log.add("part", "", "", part_id="b", started=120.0, wall_s=wall, phases={"timed passes": wall}, exit_status=None,
                gpu=["GPU-bbbbbbbb-1"])
    got = parts(tmp_path)
    assert [(p.get("part_id"), p["wall_s"], p["exit_status"]) for p in got] == [(None, 5.0, 75), ("a", 9.0, 75),
                                                                                 ("b", 30.0, None)]
    md = status_markdown(m, tmp_path)
    assert "| 2 | 1970-01-01 00:01 | 9 s | 9 s | — | 75 | aaaaaaaa |" in md
    assert "| 3 | 1970-01-01 00:02 | 30 s | 30 s | — | — (no end: lost or running) | bbbbbbbb |" in md
    assert "3 parts, 44 s in all" in md


def test_before_child_runs_once_the_export_is_written_and_before_the_child_starts(child, tmp_path, monkeypatch):
    events = []
    child.set([_warm(0.001), _pass(1.0), um.RESULT + json.dumps({"per_pass_s": [1.0]})])
    real_popen = um.subprocess.Popen
    monkeypatch.setattr(um.subprocess, "Popen", lambda cmd, **kw: (events.append("child"), real_popen(cmd, **kw))[1])
    um.measure_unsloth("A", CUDA, 2, 1, 1, workdir=str(tmp_path), log=lambda x: None,
                       before_child=lambda: events.append(("before", list(child.exports))))
    assert events == [("before", ["A"]), "child"]


def test_the_store_is_given_back_for_a_child_whose_offloaded_activations_need_the_host(monkeypatch):
    """Unsloth's offloaded checkpointing keeps every layer's input in host memory: where the host has less free
    than that, the harness releases the NF4 store before the child (it loads the export) and the next cell builds
    it again; where the host has room (the control), the store stays."""
    from poros.harness import cell_memory
    from poros.suites import test_matrix as tm
    from poros.store import host_memory

    built = []
    monkeypatch.setattr(cell_memory, "build_store", lambda model, **kw: (built.append(model) or _FakeStore(), {}))
    session = SimpleNamespace(stores=cell_memory.StoreCache("cpu"))
    store = session.stores.get("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64)
    need = um.offloaded_bytes(store.config, cfg)
    assert need == store.config.num_hidden_layers * 64 * store.config.hidden_size * 2
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 10 * need)
    assert tm._room_for_child(session, store, cfg) is None
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: need)
    tm._room_for_child(session, store, cfg)()
    assert store.released and session.stores.store is None
    session.stores.get("tiny-qwen3")
    assert built == ["tiny-qwen3", "tiny-qwen3"], "the next cell builds the store again"


class _FakeStore:
    config = SimpleNamespace(num_hidden_layers=4, hidden_size=64)
    released = False

    def release(self):
        self.released = True


def test_a_released_store_gives_its_host_memory_back(stores):
    import copy

    store = copy.copy(stores("tiny-qwen3"))
    assert store.host_bytes > 0 and not store.released
    store.release()
    assert store.released and store.host_bytes == 0 and store.dense == {}


def test_a_child_method_under_a_sweep_it_does_not_take_runs_once(monkeypatch, tmp_path):
    """Unsloth runs with compile off whatever a compile sweep says: the second point's cell has the first's settings
    and takes its passes (its row names them, `passes_of`) without a second child; a cell of other settings (the
    control) runs its own."""
    from poros.config import Method
    from poros.engine.methods.registry import config_for
    from poros.harness.cells import cell_config, matrix_cells
    from poros.harness.matrix import parse_matrix
    from poros.harness.results import PassLog
    from poros.suites import test_matrix as tm
    from poros.harness.cells import cell_fingerprint

    m = parse_matrix(dict(name="t", steps=2, passes=2, warmup_passes=1, batch_size=1, grad_accum=1, lora_rank=4,
                          lora_alpha=8, block_size=2, dataset="synthetic", device="cpu", stacks=["current"],
                          methods=["unsloth"], models=["tiny-qwen3"], sweep={"compile": [True, False],
                                                                              "seq_len": [64, 128]}), "t.yaml")
    cells = [c for c in matrix_cells(m) if c.method is Method.UNSLOTH]
    children = []

    def fake_unsloth(store, cfg, steps, passes, warmup, on_pass=None, **kw):
        children.append(cfg.seq_len)
        for i in range(passes):
            on_pass({"seconds": 1.0 + i, "peak_vram_gb": 2.0})

    monkeypatch.setattr(um, "measure_unsloth", fake_unsloth)
    session = SimpleNamespace(matrix=m, passlog=PassLog(tmp_path / "passes.jsonl"), resume=False, budget=None,
                              passes_per_part=None, keep_exports=False, cell_fingerprint=lambda cell: cell_fingerprint(m, cell))
    store = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2, hidden_size=8))
    written = {}
    for cell in cells:
        cfg = config_for(cell.method, cell_config(m, cell))
        tm._measure_child(session, cell, cfg, store, lambda meas, cell=cell: written.__setitem__(cell.id, meas), None)
    assert sorted(children) == [64, 128], "one child per distinct setting, not per sweep point"
    by_len = {}
    for cell in cells:
        by_len.setdefault(cell_config(m, cell).seq_len, []).append(cell.id)
    for first, second in by_len.values():
        assert written[first].passes_of is None and written[second].passes_of == first
        assert written[second].per_pass_s == written[first].per_pass_s == [1.0, 2.0]
        assert written[second].peak_vram_gb == 2.0


def test_status_reads_a_reduced_run_at_the_counts_its_parts_recorded(tmp_path, capsys):
    """A run of `--steps 2 --passes 3` records its counts in its parts: `poros bench status` reads its cells at
    them (its passes' fingerprints hold the steps), and --steps/--passes override. Control: a folder whose parts
    name no counts is read at the matrix's."""
    import yaml

    from poros.cli import main
    from poros.harness.cells import cell_fingerprint, matrix_cells

    m = _status_matrix(methods=["resident"])
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(dict(name="t", steps=4, passes=2, warmup_passes=1, seq_len=64, batch_size=1,
                                        grad_accum=1, lora_rank=4, lora_alpha=8, block_size=2, dataset="synthetic",
                                        device="cpu", stacks=["current"], methods=["resident"], models=["tiny-qwen2"])))
    from poros.harness.results import PassLog

    reduced = m.with_overrides(2, 3)
    (cell,) = matrix_cells(reduced)
    log = PassLog(tmp_path / "passes.jsonl")
    log.add("pass", cell.id, cell_fingerprint(reduced, cell), index=0, seconds=1.0)
    log.add("part", "", "", part_id="p", started=0.0, wall_s=1.0, phases={}, exit_status=75, gpu=[])
    assert main(["bench", "status", str(path), "-o", str(tmp_path)]) == 0
    assert "| tiny-qwen2 resident | not started |" in capsys.readouterr().out  # control: no counts recorded
    log.add("part", "", "", part_id="p", started=0.0, wall_s=1.0, phases={}, exit_status=75, gpu=[], steps=2, passes=3)
    assert main(["bench", "status", str(path), "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("0 of 1 timed cells done (2 steps x 3 passes each).") and "| 1 of 3 passes |" in out, out
    assert main(["bench", "status", str(path), "-o", str(tmp_path), "--steps", "4", "--passes", "2"]) == 0
    assert "| tiny-qwen2 resident | not started |" in capsys.readouterr().out
