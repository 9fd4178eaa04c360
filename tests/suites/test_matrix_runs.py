"""The matrix suite end to end (poros/suites/test_matrix.py, `pytest suites/` in a subprocess on tiny models on the
CPU): each cell's row and its parity gate against the reference (resident, resident_gc, resident_gc_offload), a
gate that fails and a cell that raises, plans and sweep points, data-parallel ranks, a matrix of one method,
--benchmark-disable, and runs cut off mid-pass or stopped at --max-minutes, then finished by --resume."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys

import pytest

from poros.harness.cells import matrix_cells
from poros.harness.matrix import parse_matrix
from poros.models.checkpoint import resolve
from tests.suite_runs import SWEPT, TINY, plugin_env, result_rows, run_suite, why


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_suite_writes_rows_and_resume_skips_them(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident", "unsloth"], "models": ["tiny-qwen3"]}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}  # unsloth: skipped without a GPU
    for r in rows:
        assert r["parity"] == "PASS" and r["parity_max_abs_diff"] == 0.0 and r["gate"] == "resident"
        assert len(r["per_pass_s"]) == 2 and r["s_per_step_median"] > 0
        assert r["provenance"]["versions"]["torch"] and "commit" in r["provenance"]["git"]
    poros_row = next(r for r in rows if r["method"] == "poros")
    assert poros_row["bytes_h2d_per_step"] > 0
    assert "unsloth needs a CUDA GPU" in proc.stdout
    again, _ = run_suite(tmp_path, matrix, "--resume")
    assert again.returncode == 0
    assert len(results.read_text().splitlines()) == len(rows)  # nothing re-measured
    assert "already in results (--resume)" in again.stdout


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_poros_only_matrix_gates_against_a_reference_it_does_not_time(tmp_path):
    matrix = {**TINY, "steps": 1, "passes": 1, "parity_steps": 1, "methods": ["poros"], "models": ["tiny-qwen2"]}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(r["method"], r["parity"], r["gate"]) for r in rows] == [("poros", "PASS", "resident")], rows


@pytest.mark.slow  # the suites end to end in a subprocess
@pytest.mark.parametrize("reference,schedule", [pytest.param("resident_gc", {}, marks=pytest.mark.extended),
                                                ("resident_gc_offload", {"offload_inputs": True, "device_inputs": 2})],
                         ids=["resident_gc", "resident_gc_offload-split"])
def test_a_matrix_without_resident_is_gated_against_resident_gc(tmp_path, reference, schedule):
    """Long-context matrices run poros and resident_gc (plain resident does not fit), or resident_gc with its
    inputs in host memory beside poros with its own split between device and host: the gate compares them,
    and both rows say which reference it ran against; poros's row records where its saved inputs lived."""
    matrix = {**TINY, **schedule, "methods": ["poros", reference], "models": ["tiny-gemma3"]}
    assert [c.id for c in matrix_cells(parse_matrix(matrix))] == [  # the reference timed first
        "model:tiny-gemma3-stack:current-gate:parity", f"model:tiny-gemma3-stack:current-method:{reference}",
        "model:tiny-gemma3-stack:current-method:poros"]
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    assert f"parity PASS (poros vs {reference} (recorded): " in proc.stdout, why(proc)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", reference}
    assert all(r["parity"] == "PASS" and r["gate"] == reference for r in rows), rows
    (poros,) = [r for r in rows if r["method"] == "poros"]
    assert poros["plan"]["host_inputs"] == ([0, 1, 2] if schedule else [])
    hidden = resolve("tiny-gemma3").config.hidden_size
    assert poros["plan"]["d2h_bytes_per_step"] == (3 * 64 * hidden * 2 if schedule else 0)


def _plugin(tmp_path, name: str, make_model_source: str) -> dict:
    """A pytest plugin module replacing PorosTrainer._make_model; returns the env that finds it."""
    return plugin_env(tmp_path, name, "import poros.engine.methods.executor as r\n" + make_model_source
                      + "r.PorosTrainer._make_model = _make_model\n")


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_parity_fail_fails_the_suite(tmp_path):
    """Negative control: with a plan that refills a buffer before its backward, run unchecked, the cells
    fail and rows say FAIL."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = _plugin(tmp_path, "inject_fault", (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from tests.faults import refill_before_backward\n"
        "orig = r.make_plan\n"
        "r.make_plan = lambda geo, cfg, *a, **k: refill_before_backward(orig(geo, cfg, *a, **k))\n"
        "r.PorosTrainer._refuse_unsafe = staticmethod(lambda plan: None)  # run the unsafe plan anyway\n"
        "_make_model = r.PorosTrainer._make_model\n"))
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-gemma3"]}
    proc, results = run_suite(tmp_path, matrix, "-p", "inject_fault", env=env)
    assert proc.returncode == 1, why(proc)
    assert "parity FAIL" in proc.stdout
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert rows and all(r["parity"] == "FAIL" for r in rows)


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_cell_that_raises_leaves_a_failed_row(tmp_path):
    """Nothing is lost: an exception in a cell (here: poros setup) is recorded as a `failed` row with
    its message, the suite exits 1, the report shows FAIL, and --resume retries the cell."""
    calls = tmp_path / "calls"
    env = _plugin(tmp_path, "inject_error", (
        "def _make_model(self):\n"
        f"    open({str(calls)!r}, 'a').write('x')\n"
        "    raise RuntimeError('injected setup error')\n"))
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    proc, results = run_suite(tmp_path, matrix, "-p", "inject_error", env=env)
    assert proc.returncode == 1, why(proc)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}  # the gate needs both: both cells fail
    assert all(r["status"] == "failed" and "injected setup error" in r["error"] for r in rows)
    assert calls.read_text() == "x"  # the gate ran once; its cells reuse the failure instead of re-running it
    from poros.harness.report import load_results, render_markdown

    assert "FAIL" in render_markdown(load_results([results]))
    again, _ = run_suite(tmp_path, matrix, "--resume", "-p", "inject_error", env=env)
    assert again.returncode == 1
    assert len(results.read_text().splitlines()) == 2 * len(rows)  # failed cells are retried on resume


@pytest.mark.slow  # the suites end to end in subprocesses
@pytest.mark.parametrize("control", [False, True])
def test_a_cell_that_fails_mid_step_leaves_nothing_to_the_next(tmp_path, control):
    """A timed cell whose step raises (an allocator at its budget's cap) is a failed row, and the tensors of that
    step do not outlive it: pytest keeps the last failure's traceback (for post-mortem debugging), whose frames held
    the step's tensors, views of the trainer's device buffers among them, which the next cells' plans then found
    allocated beside them (a failed 24 GB plan's buffers, 0.99 GB, in the 40 GB cell after it:
    experiments/h100-long-context-fa4-32k). Checked as the session ends, after every cell. Negative control: with
    the failure's frames kept as they were, the step's tensor is still alive there."""
    seen = tmp_path / "seen"
    env = plugin_env(tmp_path, "fail_mid_step", (
        "import gc, weakref\n"
        "import torch\n"
        "import poros.engine.methods.executor as X\n"
        "refs = []\n"
        "def step(self, batches=None):\n"
        "    held = torch.zeros(4096)  # a tensor of the step's, as an allocation under the cap leaves them\n"
        "    refs.append(weakref.ref(held))\n"
        "    raise RuntimeError('injected step error')\n"
        "X.PorosTrainer.step = step\n"
        + ("import poros.harness.cell_memory as M\nM.kept_failure = lambda e: e\n" if control else "")
        + "def pytest_sessionfinish(session):\n"
        "    gc.collect()\n"
        f"    open({str(seen)!r}, 'w').write('alive' if refs[0]() is not None else 'freed')\n"))
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    proc, results = run_suite(tmp_path, matrix, "-p", "fail_mid_step", env=env)
    assert proc.returncode == 1, why(proc)
    rows = {r["method"]: r for r in result_rows(results)}
    assert rows["poros"]["status"] == "failed" and "injected step error" in rows["poros"]["error"]
    assert rows["resident"]["status"] == "ok" and rows["resident"]["parity"] == "PASS"
    assert seen.read_text() == ("alive" if control else "freed")


@pytest.mark.slow  # the suites end to end in a subprocess
def test_suite_records_the_plan_beside_the_measurement(tmp_path):
    """A budget and layer-major accumulation in a matrix: rows record the settings, the plan's
    predicted peak and bytes, the resident layer count and how many parity steps ran."""
    matrix = {**TINY, "seq_len": 128, "grad_accum": 2, "vram_budget": "1GB", "methods": ["poros", "resident"],
              "models": ["tiny-qwen3"], "parity_steps": 2}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    rows = {r["method"]: r for r in map(json.loads, results.read_text().splitlines())}
    poros = rows["poros"]
    assert poros["parity"] == "PASS" and poros["parity_steps"] == 2
    assert poros["config"]["vram_budget"] == 10**9 and poros["config"]["accumulation"] == "layer"
    assert poros["resident_layers"] == 5 and poros["plan"]["resident_layers"] == [0, 1, 2, 3, 4]
    assert poros["predicted_peak_vram_gb"] and poros["bytes_h2d_per_step"] == poros["plan"]["h2d_bytes_per_step"]
    assert rows["resident"]["plan"] is None


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_cut_off_cell_still_leaves_the_benchmark_json(tmp_path):
    """A chunk's time budget ends it with SIGINT (KeyboardInterrupt) mid-benchmark: finished cells
    keep their rows and pytest-benchmark still writes its JSON (the half-run cell left out) instead
    of crashing on that cell's empty statistics."""

    env = plugin_env(
        tmp_path, "cut_off",
        "import poros.engine.methods.executor as t\n"
        "orig = t.PorosTrainer.step\n"
        "def step(self, batches=None):\n"
        "    if self.steps_done == 3:  # inside the poros cell's first timed pass (after resident's cell)\n"
        "        raise KeyboardInterrupt\n"
        "    return orig(self, batches)\n"
        "t.PorosTrainer.step = step\n")
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "bench.json"
    proc, results = run_suite(tmp_path, matrix, "-p", "cut_off", f"--benchmark-json={bench_json}", env=env)
    assert proc.returncode == 2, why(proc)  # interrupted
    assert "min() iterable argument is empty" not in proc.stdout + proc.stderr
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert [r["method"] for r in rows] == ["resident"]
    names = [b["name"] for b in json.loads(bench_json.read_text())["benchmarks"]]
    assert len(names) == 1 and "method:resident" in names[0]


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_data_parallel_matrix_runs_its_cells_on_ranks(tmp_path):
    """`gpus: 2` (two gloo processes on the CPU): the gate and each method run under torchrun; rows
    record world_size and count both ranks' tokens; Unsloth, one process, is skipped with its reason."""
    matrix = {**TINY, "steps": 1, "passes": 1, "grad_accum": 2, "gpus": 2, "parity_steps": 1,
              "methods": ["poros", "resident", "unsloth"], "models": ["tiny-qwen3"]}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}
    for r in rows:
        assert r["world_size"] == 2 and r["config"]["gpus"] == 2 and r["parity"] == "PASS"
        tokens = 2 * 64 * 2  # ranks x seq x grad_accum
        assert abs(r["tokens_per_s"] - tokens / r["s_per_step_median"]) < 1e-6 * r["tokens_per_s"]
    assert next(r for r in rows if r["method"] == "poros")["bytes_h2d_per_step"] > 0


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_matrix_of_one_method_runs(tmp_path):
    """One method with no gate (the reference alone; poros alone is gated, above): test_parity has no cell
    (pytest's empty-parameter item was an INTERNALERROR)."""
    proc, results = run_suite(tmp_path, {**TINY, "steps": 1, "methods": ["resident"], "models": ["tiny-qwen2"]})
    assert proc.returncode == 0, why(proc)
    rows = result_rows(results)
    assert [r["method"] for r in rows] == ["resident"] and rows[0]["parity"] is None and rows[0]["s_per_step_median"]


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_sweep_and_plans_are_cells_gated_by_one_reference_per_point(tmp_path):
    m = parse_matrix(SWEPT)
    ids = [c.id for c in matrix_cells(m)]
    assert ids[:5] == ["model:tiny-qwen3-stack:current-grad_accum:1-gate:parity",  # the reference timed first
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:resident",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:streamed",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:b1",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:b3"]
    assert len(ids) == 10
    proc, results = run_suite(tmp_path, SWEPT, "-k", "grad_accum:2 and (gate or plan:b1 or plan:b3 or method:resident)")
    assert proc.returncode == 0, why(proc)
    rows = result_rows(results)
    assert [(r["method"], r["plan_name"], r["sweep"]) for r in rows] == [
        ("resident", None, {"grad_accum": 2}), ("poros", "b1", {"grad_accum": 2}), ("poros", "b3", {"grad_accum": 2})]
    assert rows[1]["config"]["block_size"] == 1 and rows[1]["config"]["grad_accum"] == 2
    assert all(r["parity"] == "PASS" and r["schema"] == 2 for r in rows)
    gates = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    gates = [g for g in gates if g["kind"] == "gate"]
    # one reference recorded once, then the plans of the selected poros cells gated against it (not streamed)
    assert sorted(g["cell"].rsplit("/", 1)[1] for g in gates) == ["b1", "b3"]
    assert all(g["result"]["gate"] == "resident (recorded)" for g in gates)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_benchmark_disable_runs_the_gates_and_records_no_timing(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-gemma4"]}
    proc, results = run_suite(tmp_path, matrix, "--benchmark-disable")
    assert proc.returncode == 0, why(proc)
    rows = result_rows(results)
    assert [r["method"] for r in rows] == ["resident", "poros"]  # one row per cell, none failed
    for r in rows:
        assert r["status"] == "ok" and r["timed"] is False and r["parity"] == "PASS"
        assert r["s_per_step_median"] is None and r["per_pass_s"] == []


CUT_PASS = """import os
import poros.engine.methods.executor as t
orig = t.PorosTrainer.step
def step(self, batches=None):
    # the poros cell (timed after resident's): warm-up (2 steps), pass 1 (2 steps), then cut off inside pass 2
    if self.steps_done == 5 and os.environ.get("CUT_OFF"):
        raise KeyboardInterrupt
    return orig(self, batches)
t.PorosTrainer.step = step
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_cut_off_cell_resumes_after_its_last_finished_pass(tmp_path):
    """Killed in its second pass, a cell keeps its first (passes.jsonl); --resume runs only the rest, and
    benchmark.json keeps the cells of both runs."""

    env = plugin_env(tmp_path, "cut_pass", CUT_PASS)
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    proc, results = run_suite(tmp_path, matrix, "-p", "cut_pass", f"--benchmark-json={bench_json}",
                           env={**env, "CUT_OFF": "1"})
    assert proc.returncode == 2, why(proc)
    assert [r["method"] for r in result_rows(results)] == ["resident"]
    kept = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    first = [k for k in kept if k["kind"] == "pass" and "method:poros" in k["cell"]]
    assert [k["index"] for k in first] == [0]
    again, _ = run_suite(tmp_path, matrix, "-p", "cut_pass", f"--benchmark-json={bench_json}", "--resume", env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    poros = next(r for r in result_rows(results) if r["method"] == "poros")
    assert len(poros["per_pass_s"]) == 2 and poros["per_pass_s"][0] == first[0]["seconds"]
    benches = sorted(json.loads(bench_json.read_text())["benchmarks"], key=lambda b: b["name"])
    assert len(benches) == 2 and "method:poros" in benches[0]["name"] and "method:resident" in benches[1]["name"]
    # pytest-benchmark timed each pass as one round, the earlier run's first: its statistics are the rows'
    rows = {r["method"]: r for r in result_rows(results)}
    for bench, method in zip(benches, ("poros", "resident")):
        assert bench["stats"]["data"] == rows[method]["per_pass_s"]
        assert bench["stats"]["median"] / bench["extra_info"]["steps"] == pytest.approx(rows[method]["s_per_step_median"])


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_time_budget_stops_between_passes_and_resume_finishes(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    proc, results = run_suite(tmp_path, matrix, "--max-minutes", "0.0001")
    # stopped before anything was recorded: the same part again would get no further, so not 75 (run it again)
    assert proc.returncode == 1, why(proc)
    assert "time budget reached" in proc.stdout and "a part this short makes no progress" in proc.stdout
    assert not results.exists() or not result_rows(results)
    again, _ = run_suite(tmp_path, matrix, "--resume")
    assert again.returncode == 0, again.stdout[-2000:]
    assert {r["method"] for r in result_rows(results)} == {"poros", "resident"}
    # each run records what it spent where: the stopped one, its stop and no pass; the next, every phase
    from poros.harness.progress import parts as recorded_parts

    stopped, part = recorded_parts(tmp_path)  # each part as its last record
    assert stopped["stopped"] and stopped["exit_status"] == 1 and "timed passes" not in stopped["phases"]
    assert part["exit_status"] == 0 and not part["stopped"]
    assert {"store build", "parity gate", "trainer set-up", "warm-up", "timed passes"} <= set(part["phases"])
    assert sum(part["phases"].values()) <= part["wall_s"] + 1


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_passes_per_part_times_a_pass_of_every_cell_each_part_and_resume_finishes(tmp_path):
    """`--passes-per-part 1` on a matrix of two passes: the first part times one pass of each cell, writes no row and
    no benchmark statistics of them, and ends with 75; the second (--resume) times the other pass of each and
    writes both rows of two passes. Control: without the option one part writes both rows."""
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    assert matrix["passes"] == 2
    first, results = run_suite(tmp_path, matrix, "--passes-per-part", "1", f"--benchmark-json={tmp_path / 'b.json'}")
    assert first.returncode == 75, why(first)
    assert "1 of 2 passes timed (--passes-per-part 1 a part); --resume continues" in first.stdout
    assert not results.exists() or not result_rows(results)
    log = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    timed = [r for r in log if r["kind"] == "pass"]
    assert sorted(r["cell"].rsplit("method:", 1)[1] for r in timed) == ["poros", "resident"]
    assert all(r["index"] == 0 for r in timed)
    assert not json.loads((tmp_path / "b.json").read_text())["benchmarks"]
    second, _ = run_suite(tmp_path, matrix, "--passes-per-part", "1", "--resume")
    assert second.returncode == 0, why(second)
    rows = result_rows(results)
    assert {r["method"] for r in rows} == {"poros", "resident"} and all(len(r["per_pass_s"]) == 2 for r in rows)
    (tmp_path / "whole").mkdir()
    whole, whole_results = run_suite(tmp_path / "whole", matrix)
    assert whole.returncode == 0 and len(result_rows(whole_results)) == 2, why(whole)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_resumed_part_reuses_the_gates_an_earlier_part_ran(tmp_path):
    """A run in parts (scripts/matrix_part.sh): a later part takes the gates an earlier one recorded, whatever its
    time budget (a kept gate takes no time), and its reference's cell, selected alone, takes the plans gated so
    far rather than gating every plan again. Negative control: a gate nothing recorded starts no later than a
    budget with room for the longest gate recorded, and runs once there is room."""
    matrix = {**TINY, "steps": 1, "passes": 1, "parity_steps": 1, "methods": ["poros", "resident_gc_offload"],
              "models": ["tiny-qwen2"], "plans": {"a": {}, "b": {"block_size": 1}}}
    log = tmp_path / "passes.jsonl"

    def gates() -> list[dict]:
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "gate"]

    proc, results = run_suite(tmp_path, matrix, "-k", "not plan:b and not method:resident_gc_offload")
    assert proc.returncode == 0, why(proc)
    assert [g["cell"].rsplit("/", 1)[1] for g in gates()] == ["a"]
    # the recorded gate as if it had taken an hour: no budget of five minutes has room for another
    records = [json.loads(x) for x in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**r, "seconds": 3600.0} if r["kind"] == "gate" else r) + "\n" for r in records))

    kept, _ = run_suite(tmp_path, matrix, "--resume", "--max-minutes", "5", "-k", "not plan:b and not method:resident_gc_offload")
    assert kept.returncode == 0, why(kept)
    assert "parity PASS" in kept.stdout and "time budget" not in kept.stdout and len(gates()) == 1, why(kept)

    reference, _ = run_suite(tmp_path, matrix, "--resume", "--max-minutes", "5", "-k", "method:resident_gc_offload")
    assert reference.returncode == 0, why(reference)
    assert len(gates()) == 1, "the reference's cell gated again"
    rows = {r["method"]: r for r in result_rows(results)}
    assert rows["resident_gc_offload"]["parity"] == "PASS" and rows["resident_gc_offload"]["s_per_step_median"]

    refused, _ = run_suite(tmp_path, matrix, "--resume", "--max-minutes", "5", "-k", "plan:b")
    # longer than the whole budget: a part of that budget would stop again, so it fails (1, not 75) naming the fix
    assert refused.returncode == 1, why(refused)
    assert "a parity gate (the longest recorded took 3600 s) cannot end within --max-minutes 5 (300 s)" in \
        refused.stdout and len(gates()) == 1, why(refused)
    ran, _ = run_suite(tmp_path, matrix, "--resume", "-k", "plan:b")
    assert ran.returncode == 0, why(ran)
    assert [g["cell"].rsplit("/", 1)[1] for g in gates()] == ["a", "b"]
    assert {(r["method"], r["plan_name"]) for r in result_rows(results)} == {
        ("poros", "a"), ("resident_gc_offload", None), ("poros", "b")}


SLOW_REFERENCE = """import time
import poros.engine.verify.parity as parity
import poros.suites.test_matrix as suite

real = time.monotonic
ahead = [0.0]
suite.time = type("Clock", (), {"monotonic": staticmethod(lambda: real() + ahead[0])})


class SlowReference(parity.RecordedReference):
    def __init__(self, trainer, steps):
        super().__init__(trainer, steps)
        ahead[0] += 3600.0  # the reference's side as if it had taken an hour


parity.RecordedReference = SlowReference
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_gate_longer_than_a_part_runs_its_two_sides_in_two_parts(tmp_path):
    """A reference recorded first (resident_gc_offload) is kept in the run's folder as digests: where its side took
    so long that poros's could not end within the time budget, the part stops after it, and the next (--resume) runs
    only poros's side against the digests. Negative control: with the digests gone, the next part records the
    reference again."""
    matrix = {**TINY, "steps": 1, "passes": 1, "parity_steps": 1, "methods": ["poros", "resident_gc_offload"],
              "models": ["tiny-qwen2"]}
    log = tmp_path / "passes.jsonl"

    def records(kind: str) -> list[dict]:
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == kind]

    env = plugin_env(tmp_path, "slow_reference", SLOW_REFERENCE)
    first, results = run_suite(tmp_path, matrix, "-p", "slow_reference", "--max-minutes", "5", "-k", "gate", env=env)
    # the gated side could not end within a whole part of this budget either: 1 (raise the budget), not 75
    assert first.returncode == 1, why(first)
    assert re.search(r"the gated side of the gate \(resident_gc_offload's side took 36\d\d s and is kept\) cannot end "
                     r"within --max-minutes 5", first.stdout), why(first)
    (kept,) = records("reference")
    assert kept["seconds"] >= 3600 and not records("gate")
    digests = tmp_path / "gate-references" / kept["file"]
    assert digests.exists()

    second, _ = run_suite(tmp_path, matrix, "--resume", "-k", "gate")
    assert second.returncode == 0, why(second)
    assert "parity PASS (poros vs resident_gc_offload (recorded): " in second.stdout, why(second)
    # poros's side only, against the digests: the reference is not recorded again
    assert len(records("reference")) == 1 and [g["result"]["parity"] for g in records("gate")] == ["PASS"]

    digests.unlink()
    log.write_text("".join(json.dumps(r) + "\n" for r in map(json.loads, log.read_text().splitlines())
                           if r["kind"] != "gate"))
    third, _ = run_suite(tmp_path, matrix, "--resume", "-k", "gate")
    assert third.returncode == 0, why(third)
    assert len(records("reference")) == 2 and digests.exists(), why(third)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_kept_reference_edited_by_hand_is_refused_and_recorded_again(tmp_path):
    """A reference's digests with one hex digit changed are refused by name and recorded again: the gate PASSes,
    never a parity FAIL blamed on poros (the control, a kept file as written, is reused: the test above)."""
    matrix = {**TINY, "steps": 1, "passes": 1, "parity_steps": 1, "methods": ["poros", "resident_gc_offload"],
              "models": ["tiny-qwen2"]}
    log = tmp_path / "passes.jsonl"
    env = plugin_env(tmp_path, "slow_reference", SLOW_REFERENCE)
    first, results = run_suite(tmp_path, matrix, "-p", "slow_reference", "--max-minutes", "5", "-k", "gate", env=env)
    assert first.returncode == 1, why(first)  # the reference's side kept; the gated side cannot fit in 5 minutes
    (kept,) = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "reference"]
    digests = tmp_path / "gate-references" / kept["file"]
    doc = json.loads(gzip.open(digests, "rt").read())
    name = sorted(doc["states"][0]["grads"])[0]
    h = doc["states"][0]["grads"][name]
    doc["states"][0]["grads"][name] = ("1" if h[0] == "0" else "0") + h[1:]
    with gzip.open(digests, "wt") as f:
        json.dump(doc, f)

    second, _ = run_suite(tmp_path, matrix, "--resume", "-k", "gate", "-vv")  # -q -vv: the progress lines
    assert second.returncode == 0, why(second)
    assert f"refused {digests}: its contents do not match its checksum" in second.stdout, why(second)
    references = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "reference"]
    gates = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "gate"]
    assert len(references) == 2 and [g["result"]["parity"] for g in gates] == ["PASS"], why(second)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_parity_fail_row_is_gated_again_on_resume(tmp_path):
    """Rows and a gate outcome that say FAIL (as a gate against a lying reference wrote them) do not stick: --resume
    runs the gate again and writes the cells' rows anew, their passes kept. Negative control: PASS rows are done."""
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    proc, results = run_suite(tmp_path, matrix)
    assert proc.returncode == 0, why(proc)
    again, _ = run_suite(tmp_path, matrix, "--resume")
    assert again.returncode == 0 and "3 skipped" in again.stdout and "passed" not in again.stdout, why(again)

    log = tmp_path / "passes.jsonl"
    fail = {"parity": "FAIL", "first_mismatch": "step0.grad:x", "max_abs_diff": float("inf")}
    results.write_text("".join(json.dumps({**r, "parity": "FAIL", "parity_first_mismatch": "step0.grad:x"}) + "\n"
                               for r in result_rows(results)))
    log.write_text("".join(json.dumps({**r, "result": {**r["result"], **fail}} if r["kind"] == "gate" else r) + "\n"
                           for r in map(json.loads, log.read_text().splitlines())))
    third, _ = run_suite(tmp_path, matrix, "--resume")
    assert third.returncode == 0, why(third)
    assert "already in results" not in third.stdout, why(third)
    gates = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "gate"]
    assert [g["result"]["parity"] for g in gates] == ["FAIL", "PASS"]
    latest = {r["method"]: r for r in result_rows(results)}
    assert {m: r["parity"] for m, r in latest.items()} == {"poros": "PASS", "resident": "PASS"}
    first = {r["method"]: r for r in result_rows(results)[:2]}
    assert all(latest[m]["per_pass_s"] == first[m]["per_pass_s"] for m in first)  # its passes kept, not timed again


TERMINATED = """import os
import signal
import poros.engine.methods.executor as t
orig = t.PorosTrainer.step
def step(self, batches=None):
    # the poros cell (timed after resident's), inside its second timed pass: a scheduler's SIGTERM
    if self.steps_done == 5 and os.environ.get("TERMINATE"):
        os.kill(os.getpid(), signal.SIGTERM)
    return orig(self, batches)
t.PorosTrainer.step = step
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_benchmark_json_holds_every_timed_cell_across_a_sigterm_and_names_gpu_engine_and_passes(tmp_path):
    """A part ended by SIGTERM ends as a Ctrl-C does: its finished cell's entry is in benchmark.json; the next part
    (--resume) adds the rest. The JSON names the machine's GPUs (`machine_info.gpus`, none on a CPU), the engine
    (`commit_info`: commit, dirty, source tree), each cell's passes with their process, and `pytest-benchmark
    compare` reads it. Negative control: without the signal the first part finishes every cell."""
    from poros.provenance import git_info

    env = plugin_env(tmp_path, "terminated", TERMINATED)
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    proc, results = run_suite(tmp_path, matrix, "-p", "terminated", env={**env, "TERMINATE": "1"})
    assert proc.returncode == 2, why(proc)  # interrupted, not killed (-15)
    data = json.loads(bench_json.read_text())
    assert [b["param"] for b in data["benchmarks"]] == ["model:tiny-qwen2-stack:current-method:resident"]
    again, _ = run_suite(tmp_path, matrix, "-p", "terminated", "--resume", env=env)
    assert again.returncode == 0, why(again)
    data = json.loads(bench_json.read_text())
    assert sorted(b["param"].rpartition(":")[2] for b in data["benchmarks"]) == ["poros", "resident"]
    assert data["machine_info"]["gpus"] == [] and data["machine_info"]["torch"]
    git = git_info()
    assert data["commit_info"]["id"] == git["commit"] and data["commit_info"]["source_tree"] == git["source_tree"]
    assert data["commit_info"]["project"] == "poros" and data["commit_info"]["dirty"] == git["dirty"]
    by = {b["param"].rpartition(":")[2]: b for b in data["benchmarks"]}
    passes = by["poros"]["extra_info"]["passes"]
    assert [p["index"] for p in passes] == [0, 1] and by["poros"]["stats"]["data"] == [p["seconds"] for p in passes]
    assert passes[0]["process"] != passes[1]["process"], "pass 0 ran in the terminated part, pass 1 in the next"
    compare = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", str(bench_json)],
                             capture_output=True, text=True, timeout=120)
    assert compare.returncode == 0 and "test_step[model:tiny-qwen2-stack:current-method:resident]" in compare.stdout, \
        compare.stdout[-2000:] + compare.stderr[-2000:]

    whole = tmp_path / "whole"
    whole.mkdir()
    done, _ = run_suite(whole, matrix, "-p", "terminated", env=env)
    assert done.returncode == 0 and len(json.loads((whole / "benchmark.json").read_text())["benchmarks"]) == 2
