"""The matrix suites' pytest plugin end to end (poros/suites/plugin.py, `pytest suites/` in a subprocess on the CPU):
its session start owns the results folder as `poros bench` does, a selection with no cell runnable here is refused
in one line, and a run whose machine is lost keeps its finished cells' rows and benchmarks and its part's record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poros.harness.matrix import parse_matrix
from tests.suite_runs import REPO, TINY, plugin_env, result_rows, run_suite, why


def _suite_start(tmp_path, results: Path, *extra):
    """The suites' session start alone (its one selected cell stopped by the time budget before it starts): what it
    does to the results folder."""
    import yaml

    matrix = tmp_path / "own.yaml"
    matrix.write_text(yaml.safe_dump({**TINY, "name": "own", "methods": ["poros", "resident"],
                                      "models": ["tiny-qwen2"]}))
    cmd = [sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={matrix}", f"--results={results}",
           "-q", "-p", "no:cacheprovider", "-k", "tiny-qwen2 and parity", "--max-minutes", "0.0001", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_suites_own_their_results_folder_as_poros_bench_does(tmp_path):
    """`pytest suites/` never appends to an earlier run's rows: they move to earlier/N/ (with the stale report
    and passes); --resume keeps them only when they are this matrix's (control: refused, nothing moved)."""
    out = tmp_path / "out"
    out.mkdir()
    from tests.harness.test_results import whole_row

    rows = json.dumps(whole_row(matrix="other", model="tiny-qwen2")) + "\n"
    for name, text in (("results.jsonl", rows), ("report.md", "stale\n"), ("passes.jsonl", "")):
        (out / name).write_text(text)
    resumed = _suite_start(tmp_path, out / "results.jsonl", "--resume")
    assert resumed.returncode == 4 and "holds rows of matrix 'other', this run is 'own'" in resumed.stderr, \
        resumed.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["passes.jsonl", "report.md", "results.jsonl"]
    fresh = _suite_start(tmp_path, out / "results.jsonl")
    assert fresh.returncode == 1, fresh.stdout[-2000:] + fresh.stderr[-2000:]  # a part that recorded no cell
    assert f"kept the earlier run's passes.jsonl, report.md, results.jsonl in {out / 'earlier' / '1'}/" in \
        fresh.stdout, fresh.stdout
    # the matrix this run measures, and its pass log with the part's record
    assert sorted(p.name for p in out.iterdir()) == ["earlier", "matrix.yaml", "passes.jsonl"]
    assert (out / "earlier" / "1" / "results.jsonl").read_text() == rows


def test_a_matrix_with_no_cell_runnable_here_fails_in_one_line(tmp_path):
    proc, results = run_suite(tmp_path, {**TINY, "methods": ["unsloth"], "models": ["tiny-qwen2"]})
    assert proc.returncode == 4, why(proc)  # pytest's usage error, not 0 with every cell skipped
    assert "no selected cell can run here: unsloth needs a CUDA GPU" in proc.stdout + proc.stderr
    assert not results.exists()


LOST_MACHINE = """import os
import poros.engine.methods.executor as t
orig = t.PorosTrainer.step
def step(self, batches=None):
    # the poros cell (timed after resident's), inside pass 2: the process ends at once, as on a machine taken
    # away (no session end)
    if self.steps_done == 5 and os.environ.get("LOSE_IT"):
        os._exit(137)
    return orig(self, batches)
t.PorosTrainer.step = step
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_lost_machine_keeps_its_finished_cells_benchmarks_and_its_part(tmp_path):
    """A run whose process ends without pytest's session end (its machine taken away) keeps, besides its rows and
    passes, the benchmark of every finished cell and a record of its part up to its last finished cell; the
    next part (--resume) records its own, and the status lists both."""

    from poros.harness.progress import parts, status_markdown

    env = plugin_env(tmp_path, "lost_machine", LOST_MACHINE)
    matrix = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    proc, results = run_suite(tmp_path, matrix, "-p", "lost_machine", f"--benchmark-json={bench_json}",
                           env={**env, "LOSE_IT": "1"})
    assert proc.returncode == 137 and "passed" not in proc.stdout, why(proc)  # no session end ran
    assert [r["method"] for r in result_rows(results)] == ["resident"]
    names = [b["name"] for b in json.loads(bench_json.read_text())["benchmarks"]]
    assert len(names) == 1 and "method:resident" in names[0]
    (lost,) = parts(tmp_path)
    assert lost["exit_status"] is None and lost["gpu"] is not None and "timed passes" in lost["phases"]
    records = [json.loads(x) for x in (tmp_path / "passes.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "part"]) == 3  # at its start, after the gate, after resident
    again, _ = run_suite(tmp_path, matrix, "-p", "lost_machine", f"--benchmark-json={bench_json}", "--resume", env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    first, second = parts(tmp_path)
    assert first == lost and second["exit_status"] == 0 and second["part_id"] != lost["part_id"]
    names = sorted(b["name"] for b in json.loads(bench_json.read_text())["benchmarks"])
    assert len(names) == 2 and "method:poros" in names[0] and "method:resident" in names[1]
    table = status_markdown(parse_matrix(matrix), tmp_path)
    assert "| — (no end: lost or running) |" in table and "2 parts" in table, table


LOST_BEFORE_ROW = """import os
import poros.harness.results as r
orig = r.ResultsWriter.append
def append(self, row):
    # poros's row: the process ends before it is written, after every pass of the cell is in the pass log
    if row.get("method") == "poros" and os.environ.get("LOSE_IT"):
        os._exit(137)
    return orig(self, row)
r.ResultsWriter.append = append
"""


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_finished_cells_lost_benchmark_is_written_from_its_row(tmp_path):
    """A cell whose benchmark was never written (its part lost after the last pass, before the row; or after the
    row, under a harness that wrote the JSON only at its end) gets its entry in the next part (--resume): the
    rounds are the row's pass seconds, in pytest-benchmark's statistics, and the extra info the row's. A cell
    whose entry was kept is left as it was."""
    env = plugin_env(tmp_path, "lost_before_row", LOST_BEFORE_ROW)
    matrix = {**TINY, "methods": ["resident", "poros"], "models": ["tiny-qwen2"]}
    bench_json = tmp_path / "benchmark.json"
    entries = lambda: {b["name"].partition("method:")[2].rstrip("]"): b  # noqa: E731
                       for b in json.loads(bench_json.read_text())["benchmarks"]}
    proc, results = run_suite(tmp_path, matrix, "-p", "lost_before_row", f"--benchmark-json={bench_json}",
                              env={**env, "LOSE_IT": "1"})
    assert proc.returncode == 137, why(proc)
    assert [r["method"] for r in result_rows(results)] == ["resident"] and sorted(entries()) == ["resident"]
    again, _ = run_suite(tmp_path, matrix, "-p", "lost_before_row", f"--benchmark-json={bench_json}", "--resume",
                         env=env)
    assert again.returncode == 0, again.stdout[-2000:]
    rows = {r["method"]: r for r in result_rows(results)}
    poros = entries()["poros"]  # every pass timed by the lost part: no round ran in this one
    assert poros["stats"]["data"] == rows["poros"]["per_pass_s"] and poros["stats"]["rounds"] == 2
    assert poros["extra_info"]["s_per_step_median"] == rows["poros"]["s_per_step_median"]
    assert poros["stats"]["median"] == sorted(rows["poros"]["per_pass_s"])[1] / 2 + \
        sorted(rows["poros"]["per_pass_s"])[0] / 2

    # resident's entry as a harness that wrote the JSON only at its end would have lost it
    data = json.loads(bench_json.read_text())
    kept = entries()["poros"]
    data["benchmarks"] = [b for b in data["benchmarks"] if "method:resident" not in b["name"]]
    bench_json.write_text(json.dumps(data))
    assert sorted(entries()) == ["poros"]  # control: the entry is gone before the next part
    third, _ = run_suite(tmp_path, matrix, f"--benchmark-json={bench_json}", "--resume")
    assert third.returncode == 0, third.stdout[-2000:]
    said = {m: next(x for x in third.stdout.splitlines() if f"tiny-qwen2 {m}: skipped" in x) for m in ("resident", "poros")}
    assert said["resident"].endswith("its benchmark entry written from the row") and "entry" not in said["poros"], said
    resident = entries()["resident"]
    assert resident["stats"]["data"] == rows["resident"]["per_pass_s"]
    assert resident["extra_info"]["parity"] == "PASS" and resident["extra_info"]["steps"] == 2
    assert entries()["poros"] == kept
