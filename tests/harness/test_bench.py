"""The harness: cell order, capability gates, results rows, resume, and the suites end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poros.harness.cells import matrix_cells, model_unavailable
from poros.harness.matrix import load_matrix, parse_matrix
from poros.harness.results import ResultsWriter
from poros.models.checkpoint import resolve

REPO = Path(__file__).resolve().parents[2]
TINY = dict(name="t", steps=2, passes=2, warmup_passes=1, seq_len=64, batch_size=1, grad_accum=1, lora_rank=4,
            lora_alpha=8, block_size=2, dataset="synthetic", device="cpu", stacks=["current"])


def test_cells_run_model_by_model_parity_first():
    m = load_matrix("cpu")
    cells = matrix_cells(m)
    assert len(cells) == len(m.models) * (1 + len(m.methods))
    for i, model in enumerate(m.models):
        chunk = cells[i * (1 + len(m.methods)) : (i + 1) * (1 + len(m.methods))]
        assert [c.model for c in chunk] == [model] * len(chunk)
        assert chunk[0].method is None and [c.method for c in chunk[1:]] == list(m.methods)


def test_cell_ids_read_like_report_rows():
    m = load_matrix("cpu")
    ids = [c.id for c in matrix_cells(m)]
    assert "model:tiny-qwen3-stack:current-gate:parity" in ids
    assert "model:tiny-qwen3-stack:current-method:poros" in ids
    from _pytest.mark.expression import Expression

    for expr in ("method:resident", "model:tiny-qwen3 and method:poros", "stack:current and gate:parity"):
        Expression.compile(expr)  # the -k forms the ids are made for parse (`method=resident` did not)


def test_real_shapes_are_gated_off_the_cpu():
    assert "GPU" in model_unavailable("qwen2.5-72b", "cpu")
    assert model_unavailable("qwen2.5-72b", "cuda") is None
    assert model_unavailable("tiny-qwen2", "cpu") is None


def test_stack_mismatch_names_the_tox_env():
    """A pinned stack is either the running environment (inside its own tox env) or names that env."""
    from importlib import metadata

    m = load_matrix("b300")
    have = metadata.version("torch").split("+")[0], metadata.version("transformers")
    assert len(m.stacks) == 2
    for s in m.stacks:
        why = s.mismatch()
        if (s.torch.split("+")[0], s.transformers) == have:
            assert why is None, why
        else:
            assert why and f"tox -e {s.name}" in why, why


def test_results_writer_appends_and_reports_done(tmp_path):
    w = ResultsWriter(tmp_path / "r.jsonl")
    w.append({"matrix": "t", "model": "a", "stack_name": "current", "method": "poros", "status": "ok"})
    w.append({"matrix": "t", "model": "a", "stack_name": "current", "method": "resident", "status": "failed"})
    w.append({"matrix": "u", "model": "a", "stack_name": "current", "method": "resident", "status": "ok"})
    assert set(w.done("t")) == {("a", "current", "poros", None, "")}
    assert len(w.rows()) == 3


def _suite(tmp_path, matrix: dict, *extra, env=None):
    path = tmp_path / "m.yaml"
    import yaml

    path.write_text(yaml.safe_dump(matrix))
    parse_matrix(matrix)  # the fixture itself must be valid
    results = tmp_path / "results.jsonl"
    cmd = [sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={path}", f"--results={results}",
           "-q", "-p", "no:cacheprovider", "-rs", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    return proc, results


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_suite_writes_rows_and_resume_skips_them(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident", "unsloth"], "models": ["tiny-qwen3"]}
    proc, results = _suite(tmp_path, matrix)
    assert proc.returncode == 0, proc.stdout[-2000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}  # unsloth: skipped without a GPU
    for r in rows:
        assert r["parity"] == "PASS" and r["parity_max_abs_diff"] == 0.0 and r["gate"] == "resident"
        assert len(r["per_pass_s"]) == 2 and r["s_per_step_median"] > 0
        assert r["provenance"]["versions"]["torch"] and "commit" in r["provenance"]["git"]
    poros_row = next(r for r in rows if r["method"] == "poros")
    assert poros_row["bytes_h2d_per_step"] > 0
    assert "unsloth needs a CUDA GPU" in proc.stdout
    again, _ = _suite(tmp_path, matrix, "--resume")
    assert again.returncode == 0
    assert len(results.read_text().splitlines()) == len(rows)  # nothing re-measured
    assert "already in results (--resume)" in again.stdout


def test_a_poros_cell_is_never_timed_without_its_gate():
    """A matrix of poros alone still has its gate cell (resident QLoRA run for the reference, not timed); a
    matrix of no gated method has none."""
    poros = matrix_cells(parse_matrix({**TINY, "methods": ["poros"], "models": ["tiny-qwen2"]}))
    assert [c.id for c in poros] == ["model:tiny-qwen2-stack:current-gate:parity",
                                     "model:tiny-qwen2-stack:current-method:poros"]
    alone = matrix_cells(parse_matrix({**TINY, "methods": ["resident"], "models": ["tiny-qwen2"]}))
    assert [c.id for c in alone] == ["model:tiny-qwen2-stack:current-method:resident"]


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_poros_only_matrix_gates_against_a_reference_it_does_not_time(tmp_path):
    matrix = {**TINY, "steps": 1, "passes": 1, "parity_steps": 1, "methods": ["poros"], "models": ["tiny-qwen2"]}
    proc, results = _suite(tmp_path, matrix)
    assert proc.returncode == 0, proc.stdout[-2000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(r["method"], r["parity"], r["gate"]) for r in rows] == [("poros", "PASS", "resident")], rows


def _suite_start(tmp_path, results: Path, *extra):
    """The suites' session start alone (every cell deselected): what it does to the results folder."""
    import yaml

    matrix = tmp_path / "own.yaml"
    matrix.write_text(yaml.safe_dump({**TINY, "name": "own", "methods": ["poros", "resident"],
                                      "models": ["tiny-qwen2"]}))
    cmd = [sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={matrix}", f"--results={results}",
           "-q", "-p", "no:cacheprovider", "-k", "no-such-cell", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_suites_own_their_results_folder_as_poros_bench_does(tmp_path):
    """`pytest suites/` never appends to an earlier run's rows: they move to earlier/N/ (with the stale report
    and passes); --resume keeps them only when they are this matrix's (control: refused, nothing moved)."""
    out = tmp_path / "out"
    out.mkdir()
    rows = json.dumps({"matrix": "other", "model": "tiny-qwen2", "method": "poros"}) + "\n"
    for name, text in (("results.jsonl", rows), ("report.md", "stale\n"), ("passes.jsonl", "")):
        (out / name).write_text(text)
    resumed = _suite_start(tmp_path, out / "results.jsonl", "--resume")
    assert resumed.returncode == 4 and "holds rows of matrix 'other', this run is 'own'" in resumed.stderr, \
        resumed.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["passes.jsonl", "report.md", "results.jsonl"]
    fresh = _suite_start(tmp_path, out / "results.jsonl")
    assert fresh.returncode == 5, fresh.stdout[-2000:] + fresh.stderr[-2000:]  # no cell selected
    assert f"kept the earlier run's passes.jsonl, report.md, results.jsonl in {out / 'earlier' / '1'}/" in \
        fresh.stdout, fresh.stdout
    assert sorted(p.name for p in out.iterdir()) == ["earlier"]
    assert (out / "earlier" / "1" / "results.jsonl").read_text() == rows


@pytest.mark.slow  # the suites end to end in a subprocess
@pytest.mark.parametrize("reference,schedule", [("resident_gc", {}),
                                                ("resident_gc_offload", {"offload_inputs": True, "device_inputs": 2})],
                         ids=["resident_gc", "resident_gc_offload-split"])
def test_a_matrix_without_resident_is_gated_against_resident_gc(tmp_path, reference, schedule):
    """Long-context matrices run poros and resident_gc (plain resident does not fit), or resident_gc with its
    inputs in host memory beside poros with its own split between device and host: the gate compares them,
    and both rows say which reference it ran against; poros's row records where its saved inputs lived."""
    matrix = {**TINY, **schedule, "methods": ["poros", reference], "models": ["tiny-gemma3"]}
    assert [c.id for c in matrix_cells(parse_matrix(matrix))] == [
        "model:tiny-gemma3-stack:current-gate:parity", "model:tiny-gemma3-stack:current-method:poros",
        f"model:tiny-gemma3-stack:current-method:{reference}"]
    proc, results = _suite(tmp_path, matrix)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert f"parity PASS (poros vs {reference} (recorded): " in proc.stdout, proc.stdout[-2000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", reference}
    assert all(r["parity"] == "PASS" and r["gate"] == reference for r in rows), rows
    (poros,) = [r for r in rows if r["method"] == "poros"]
    assert poros["plan"]["host_inputs"] == ([0, 1, 2] if schedule else [])
    hidden = resolve("tiny-gemma3").config.hidden_size
    assert poros["plan"]["d2h_bytes_per_step"] == (3 * 64 * hidden * 2 if schedule else 0)


def _plugin(tmp_path, name: str, make_model_source: str) -> dict:
    """A pytest plugin module replacing PorosTrainer._make_model; returns the env that finds it."""
    import os

    (tmp_path / f"{name}.py").write_text(
        "import poros.engine.executor as r\n" + make_model_source + "r.PorosTrainer._make_model = _make_model\n")
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


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
    proc, results = _suite(tmp_path, matrix, "-p", "inject_fault", env=env)
    assert proc.returncode == 1, proc.stdout[-2000:]
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
    proc, results = _suite(tmp_path, matrix, "-p", "inject_error", env=env)
    assert proc.returncode == 1, proc.stdout[-2000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}  # the gate needs both: both cells fail
    assert all(r["status"] == "failed" and "injected setup error" in r["error"] for r in rows)
    assert calls.read_text() == "x"  # the gate ran once; its cells reuse the failure instead of re-running it
    from poros.harness.report import load_results, render_markdown

    assert "FAIL" in render_markdown(load_results([results]))
    again, _ = _suite(tmp_path, matrix, "--resume", "-p", "inject_error", env=env)
    assert again.returncode == 1
    assert len(results.read_text().splitlines()) == 2 * len(rows)  # failed cells are retried on resume


@pytest.mark.slow  # the suites end to end in a subprocess
def test_suite_records_the_plan_beside_the_measurement(tmp_path):
    """A budget and layer-major accumulation in a matrix: rows record the settings, the plan's
    predicted peak and bytes, the resident layer count and how many parity steps ran."""
    matrix = {**TINY, "seq_len": 128, "grad_accum": 2, "vram_budget": "1GB", "methods": ["poros", "resident"],
              "models": ["tiny-qwen3"], "parity_steps": 2}
    proc, results = _suite(tmp_path, matrix)
    assert proc.returncode == 0, proc.stdout[-2000:]
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
    import os

    (tmp_path / "cut_off.py").write_text(
        "import poros.engine.trainer as t\n"
        "orig = t.ResidentTrainer.step\n"
        "def step(self, batches=None):\n"
        "    if self.steps_done == 3:  # inside the resident cell's first timed pass\n"
        "        raise KeyboardInterrupt\n"
        "    return orig(self, batches)\n"
        "t.ResidentTrainer.step = step\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "bench.json"
    proc, results = _suite(tmp_path, matrix, "-p", "cut_off", f"--benchmark-json={bench_json}", env=env)
    assert proc.returncode == 2, proc.stdout[-2000:]  # interrupted
    assert "min() iterable argument is empty" not in proc.stdout + proc.stderr
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert [r["method"] for r in rows] == ["poros"]
    names = [b["name"] for b in json.loads(bench_json.read_text())["benchmarks"]]
    assert len(names) == 1 and "method:poros" in names[0]


def test_model_overrides_change_only_that_models_schedule():
    from poros.harness.cells import train_config

    m = parse_matrix({**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2", "tiny-qwen3"],
                      "overlap_backward": True, "model_overrides": {"tiny-qwen3": {"overlap_backward": False,
                                                                                   "vram_budget": "300MB"}}})
    q2, q3 = train_config(m, "tiny-qwen2"), train_config(m, "tiny-qwen3")
    assert q2.overlap_backward and q2.vram_budget is None
    assert not q3.overlap_backward and q3.vram_budget == 300 * 10**6
    assert q2.replace(model="tiny-qwen3", overlap_backward=False, vram_budget=300 * 10**6) == q3  # nothing else


def test_bad_model_overrides_are_refused_with_every_problem():
    import pytest

    from poros.errors import ConfigError

    bad = {**TINY, "methods": ["poros"], "models": ["tiny-qwen2"], "model_overrides": {
        "tiny-qwen3": {"cuda_graphs": False},  # not in the matrix
        "tiny-qwen2": {"seq_len": 128, "cuda_graphs": "yes", "vram_budget": "lots"}}}
    with pytest.raises(ConfigError) as e:
        parse_matrix(bad)
    text = str(e.value)
    for needle in ("model_overrides.tiny-qwen3: not one of this matrix's models",
                   "model_overrides.tiny-qwen2.seq_len: not overridable", "cuda_graphs: expected true or false",
                   "vram_budget: expected a size such as 24GB"):
        assert needle in text, text


@pytest.mark.slow  # the suites end to end in a subprocess
def test_a_data_parallel_matrix_runs_its_cells_on_ranks(tmp_path):
    """`gpus: 2` (two gloo processes on the CPU): the gate and each method run under torchrun; rows
    record world_size and count both ranks' tokens; Unsloth, one process, is skipped with its reason."""
    matrix = {**TINY, "steps": 1, "passes": 1, "grad_accum": 2, "gpus": 2, "parity_steps": 1,
              "methods": ["poros", "resident", "unsloth"], "models": ["tiny-qwen3"]}
    proc, results = _suite(tmp_path, matrix)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert {r["method"] for r in rows} == {"poros", "resident"}
    for r in rows:
        assert r["world_size"] == 2 and r["config"]["gpus"] == 2 and r["parity"] == "PASS"
        tokens = 2 * 64 * 2  # ranks x seq x grad_accum
        assert abs(r["tokens_per_s"] - tokens / r["s_per_step_median"]) < 1e-6 * r["tokens_per_s"]
    assert next(r for r in rows if r["method"] == "poros")["bytes_h2d_per_step"] > 0


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    from poros.errors import CapabilityError
    from poros.harness.preflight import check_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CapabilityError, match="2 data-parallel ranks need 2 CUDA GPUs; this host has 1"):
        check_ranks(2, "cuda", "m.yaml: gpus")
    check_ranks(2, "cpu", "m.yaml: gpus")  # processes on the CPU
    check_ranks(1, "cuda", "m.yaml: gpus")


def _rows(results: Path) -> list[dict]:
    return [json.loads(x) for x in results.read_text().splitlines()]


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_matrix_of_one_method_runs(tmp_path):
    """One method with no gate (the reference alone; poros alone is gated, above): test_parity has no cell
    (pytest's empty-parameter item was an INTERNALERROR)."""
    proc, results = _suite(tmp_path, {**TINY, "steps": 1, "methods": ["resident"], "models": ["tiny-qwen2"]})
    assert proc.returncode == 0, proc.stdout[-2000:]
    rows = _rows(results)
    assert [r["method"] for r in rows] == ["resident"] and rows[0]["parity"] is None and rows[0]["s_per_step_median"]


def test_a_matrix_with_no_cell_runnable_here_fails_in_one_line(tmp_path):
    proc, results = _suite(tmp_path, {**TINY, "methods": ["unsloth"], "models": ["tiny-qwen2"]})
    assert proc.returncode == 4, proc.stdout[-2000:]  # pytest's usage error, not 0 with every cell skipped
    assert "no selected cell can run here: unsloth needs a CUDA GPU" in proc.stdout + proc.stderr
    assert not results.exists()


SWEPT = {**{k: v for k, v in TINY.items() if k != "grad_accum"}, "steps": 1, "passes": 1, "methods": ["poros", "resident"], "models": ["tiny-qwen3"],
         "sweep": {"grad_accum": [1, 2]}, "plans": {"streamed": {}, "b1": {"block_size": 1}, "b3": {"block_size": 3}}}


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_sweep_and_plans_are_cells_gated_by_one_reference_per_point(tmp_path):
    m = parse_matrix(SWEPT)
    ids = [c.id for c in matrix_cells(m)]
    assert ids[:5] == ["model:tiny-qwen3-stack:current-grad_accum:1-gate:parity",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:streamed",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:b1",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:poros-plan:b3",
                       "model:tiny-qwen3-stack:current-grad_accum:1-method:resident"]
    assert len(ids) == 10
    proc, results = _suite(tmp_path, SWEPT, "-k", "grad_accum:2 and (gate or plan:b1 or plan:b3 or method:resident)")
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = _rows(results)
    assert [(r["method"], r["plan_name"], r["sweep"]) for r in rows] == [
        ("poros", "b1", {"grad_accum": 2}), ("poros", "b3", {"grad_accum": 2}), ("resident", None, {"grad_accum": 2})]
    assert rows[0]["config"]["block_size"] == 1 and rows[0]["config"]["grad_accum"] == 2
    assert all(r["parity"] == "PASS" and r["schema"] == 2 for r in rows)
    gates = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    gates = [g for g in gates if g["kind"] == "gate"]
    # one reference recorded once, then the plans of the selected poros cells gated against it (not streamed)
    assert sorted(g["cell"].rsplit("/", 1)[1] for g in gates) == ["b1", "b3"]
    assert all(g["result"]["gate"] == "resident (recorded)" for g in gates)


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_benchmark_disable_runs_the_gates_and_records_no_timing(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-gemma4"]}
    proc, results = _suite(tmp_path, matrix, "--benchmark-disable")
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = _rows(results)
    assert [r["method"] for r in rows] == ["poros", "resident"]  # one row per cell, none failed
    for r in rows:
        assert r["status"] == "ok" and r["timed"] is False and r["parity"] == "PASS"
        assert r["s_per_step_median"] is None and r["per_pass_s"] == []


CUT_PASS = """import os
import poros.engine.trainer as t
orig = t.ResidentTrainer.step
def step(self, batches=None):
    # the resident cell: warm-up (2 steps), pass 1 (2 steps), then cut off inside pass 2
    if self.steps_done == 5 and os.environ.get("CUT_OFF"):
        raise KeyboardInterrupt
    return orig(self, batches)
t.ResidentTrainer.step = step
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_cut_off_cell_resumes_after_its_last_finished_pass(tmp_path):
    """Killed in its second pass, a cell keeps its first (passes.jsonl); --resume runs only the rest, and
    benchmark.json keeps the cells of both runs."""
    import os

    (tmp_path / "cut_pass.py").write_text(CUT_PASS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    proc, results = _suite(tmp_path, matrix, "-p", "cut_pass", f"--benchmark-json={bench_json}",
                           env={**env, "CUT_OFF": "1"})
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert [r["method"] for r in _rows(results)] == ["poros"]
    kept = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    first = [k for k in kept if k["kind"] == "pass" and "method:resident" in k["cell"]]
    assert [k["index"] for k in first] == [0]
    again, _ = _suite(tmp_path, matrix, "-p", "cut_pass", f"--benchmark-json={bench_json}", "--resume", env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    resident = next(r for r in _rows(results) if r["method"] == "resident")
    assert len(resident["per_pass_s"]) == 2 and resident["per_pass_s"][0] == first[0]["seconds"]
    benches = sorted(json.loads(bench_json.read_text())["benchmarks"], key=lambda b: b["name"])
    assert len(benches) == 2 and "method:poros" in benches[0]["name"] and "method:resident" in benches[1]["name"]
    # pytest-benchmark timed each pass as one round, the earlier run's first: its statistics are the rows'
    rows = {r["method"]: r for r in _rows(results)}
    for bench, method in zip(benches, ("poros", "resident")):
        assert bench["stats"]["data"] == rows[method]["per_pass_s"]
        assert bench["stats"]["median"] / bench["extra_info"]["steps"] == pytest.approx(rows[method]["s_per_step_median"])


LOST_MACHINE = """import os
import poros.engine.trainer as t
orig = t.ResidentTrainer.step
def step(self, batches=None):
    # the resident cell, inside pass 2: the process ends at once, as on a machine taken away (no session end)
    if self.steps_done == 5 and os.environ.get("LOSE_IT"):
        os._exit(137)
    return orig(self, batches)
t.ResidentTrainer.step = step
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_lost_machine_keeps_its_finished_cells_benchmarks_and_its_part(tmp_path):
    """A run whose process ends without pytest's session end (its machine taken away) keeps, besides its rows and
    passes, the benchmark of every finished cell and a record of its part up to its last finished cell; the
    next part (--resume) records its own, and the status lists both."""
    import os

    from poros.harness.progress import parts, status_markdown

    (tmp_path / "lost_machine.py").write_text(LOST_MACHINE)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    proc, results = _suite(tmp_path, matrix, "-p", "lost_machine", f"--benchmark-json={bench_json}",
                           env={**env, "LOSE_IT": "1"})
    assert proc.returncode == 137 and "passed" not in proc.stdout, proc.stdout[-2000:]  # no session end ran
    assert [r["method"] for r in _rows(results)] == ["poros"]
    names = [b["name"] for b in json.loads(bench_json.read_text())["benchmarks"]]
    assert len(names) == 1 and "method:poros" in names[0]
    (lost,) = parts(tmp_path)
    assert lost["exit_status"] is None and lost["gpu"] is not None and "timed passes" in lost["phases"]
    records = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "part"]) == 3  # at its start, after the gate, after poros
    again, _ = _suite(tmp_path, matrix, "-p", "lost_machine", f"--benchmark-json={bench_json}", "--resume", env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    first, second = parts(tmp_path)
    assert first == lost and second["exit_status"] == 0 and second["part_id"] != lost["part_id"]
    names = sorted(b["name"] for b in json.loads(bench_json.read_text())["benchmarks"])
    assert len(names) == 2 and "method:poros" in names[0] and "method:resident" in names[1]
    table = status_markdown(parse_matrix(matrix), tmp_path)
    assert "| — (no end: lost or running) |" in table and "2 parts" in table, table


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_time_budget_stops_between_passes_and_resume_finishes(tmp_path):
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    proc, results = _suite(tmp_path, matrix, "--max-minutes", "0.0001")
    assert proc.returncode == 75, proc.stdout[-2000:]  # stopped with cells left: run it again
    assert "time budget reached" in proc.stdout
    assert not results.exists() or not _rows(results)
    again, _ = _suite(tmp_path, matrix, "--resume")
    assert again.returncode == 0, again.stdout[-2000:]
    assert {r["method"] for r in _rows(results)} == {"poros", "resident"}
    # each run that ran a cell records what it spent where: the stopped one ran none
    from poros.harness.progress import parts as recorded_parts

    parts = recorded_parts(tmp_path)  # each part as its last record
    assert len(parts) == 1 and parts[0]["exit_status"] == 0 and not parts[0]["stopped"]
    assert {"store build", "parity gate", "trainer set-up", "warm-up", "timed passes"} <= set(parts[0]["phases"])
    assert sum(parts[0]["phases"].values()) <= parts[0]["wall_s"] + 1


def test_resume_refuses_rows_of_other_computed_settings_plans_or_stacks(tmp_path):
    from poros.errors import PorosError
    from poros.harness.cells import cell_config
    from poros.harness.result_row import record
    from poros.harness.preflight import check_resume

    m = parse_matrix(SWEPT)
    cell = [c for c in matrix_cells(m) if c.plan == "b1"][1]  # at grad_accum 2
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False)
    check_resume([row], m, "r.jsonl")  # its own row: kept
    for change, named in ((dict(sweep={"grad_accum": [1, 4]}), "a cell this matrix does not have"),
                          (dict(sweep={"grad_accum": [1, 2]}, lora_rank=8), "lora_rank: the rows have 4, the matrix 8"),
                          (dict(plans={"streamed": {}, "b1": {"block_size": 2}}), "block_size: the rows have 1"),
                          (dict(plans={"streamed": {}}), "a cell this matrix does not have")):
        with pytest.raises(PorosError, match=named):
            check_resume([row], parse_matrix({**SWEPT, **change}), "r.jsonl")
    with pytest.raises(PorosError, match="ran on stack 'torch 0.0'"):
        check_resume([{**row, "stack": "torch 0.0"}], m, "r.jsonl")


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    from poros.harness.matrix import load_matrix

    path = tmp_path / "m.yaml"
    import yaml

    path.write_text(yaml.safe_dump({**TINY, "methods": ["poros"], "models": ["tiny-qwen2"]}) + "lr: 1e-4\n")
    assert yaml.safe_load(path.read_text())["lr"] == "1e-4"  # PyYAML's own reading: a string
    assert load_matrix(str(path)).lr == 1e-4


def test_copy_rate_counts_only_the_bytes_its_time_covers():
    """With saved inputs in host memory, their bytes come back on the copy stream outside the timed
    weight copies: counting them in read 63.6 GB/s on a 55 GB/s link."""
    from poros.harness.result_row import copy_summary

    step = {"bytes_h2d": 110, "input_bytes_h2d": 55, "copy_s": 1e-9, "copy_wait_s": 0.0}
    out = copy_summary([step, step])
    assert out["bytes_h2d_per_step"] == 110 and out["weight_bytes_h2d_per_step"] == 55
    assert out["copy_gbps"] == pytest.approx(55.0)


def test_rows_count_the_attention_calls_recomputes_took_from_the_forward():
    from poros.harness.result_row import copy_summary

    base = {"bytes_h2d": 10, "copy_s": 1.0, "copy_wait_s": 0.0}
    assert "attention_replayed_per_step" not in copy_summary([base])
    out = copy_summary([{**base, "attention_replayed": 80, "attention_computed": 0},
                        {**base, "attention_replayed": 78, "attention_computed": 2}])
    assert out["attention_replayed_per_step"] == 79 and out["attention_computed_per_step"] == 1


def test_rows_carry_the_cuda_graph_templates_capture_errors():
    from poros.harness.result_row import copy_summary

    base = {"bytes_h2d": 10, "copy_s": 1.0, "copy_wait_s": 0.0}
    assert "capture_errors" not in copy_summary([base])
    first = {**base, "graphs_captured": 3, "capture_errors": 1, "template_fallbacks": 2, "layer_templates": 4}
    last = {**first, "template_fallbacks": 5}  # counted from the trainer's start: the last step's holds all
    out = copy_summary([first, last])
    assert (out["graphs_captured"], out["capture_errors"], out["template_fallbacks"]) == (3, 1, 5)


def test_a_kept_gate_failure_holds_none_of_its_frames_locals():
    """A gate outcome that raised is kept for every cell that needs it; the trainer that failed (a local of
    a frame in its traceback, or in its cause's) must not stay on the device with it."""
    import gc
    import weakref

    from poros.harness.cell_memory import kept_failure

    class Trainer:
        pass

    refs = []

    def build():
        trainer = Trainer()
        refs.append(weakref.ref(trainer))
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise RuntimeError("out of memory") from inner

    def failure():
        try:
            build()
        except RuntimeError as e:
            return e

    held = failure()
    gc.collect()
    assert refs[0]() is not None  # negative control: the traceback holds the trainer
    assert kept_failure(held) is held and str(held) == "out of memory" and str(held.__cause__) == "inner"
    gc.collect()
    assert refs[0]() is None


def test_rows_count_the_allocator_retries_of_the_timed_passes(monkeypatch):
    """Each timed pass records how often torch's allocator released its cache and tried again (a stall at a
    budget's cap); warm-up retries are not counted, a resumed pass keeps its count, and a row that misses
    a pass's count says nothing rather than a part."""
    from types import SimpleNamespace

    from poros.harness import timing

    count = iter(range(0, 1000, 3))  # each read of the counter: 3 retries since the last
    monkeypatch.setattr(timing, "alloc_retries", lambda device: next(count) if device == "cuda" else None)
    monkeypatch.setattr(timing, "_sync", lambda device: None)
    monkeypatch.setattr(timing, "_peaks", lambda device, nvml: dict.fromkeys(timing.PEAKS))
    trainer = SimpleNamespace(step=lambda: SimpleNamespace(counters={}, loss=0.0))
    cfg = SimpleNamespace(device=SimpleNamespace(value="cuda"))
    earlier = [{"seconds": 1.0, "counters": [], "alloc_retries": 10}]
    meas = timing.measure(trainer, cfg, steps=2, passes=3, warmup=1, earlier=earlier)
    assert meas.alloc_retries == [10, 3, 3]
    assert timing.retries_per_step(meas, steps=2) == pytest.approx(16 / 6)
    assert timing.retries_per_step(timing.Measurement([1.0, 1.0], alloc_retries=[2, None]), steps=1) is None
    assert timing.retries_per_step(timing.Measurement([1.0], alloc_retries=[]), steps=1) is None
    cpu = timing.measure(trainer, SimpleNamespace(device=SimpleNamespace(value="cpu")), steps=1, passes=1, warmup=0)
    assert cpu.alloc_retries == [None] and timing.retries_per_step(cpu, 1) is None
