"""Comparing a run's timings with an earlier run's benchmark.json (`--benchmark-compare`,
`--benchmark-compare-fail`), through `poros bench` and `pytest suites/`: a generous threshold passes, a
saved run made much faster fails it (the check can fail), and comparisons that would compare nothing are
refused before any cell runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from poros.errors import ConfigError, PorosError
from poros.harness.cells import matrix_cells
from poros.harness.compare import current_name, load_compare_source, parse_compare_fail
from poros.harness.matrix import load_matrix

REPO = Path(__file__).resolve().parents[2]
TINY = dict(name="compare", steps=1, passes=2, warmup_passes=1, seq_len=64, batch_size=1, grad_accum=1, lora_rank=4,
            lora_alpha=8, block_size=2, dataset="synthetic", device="cpu", stacks=["current"], methods=["poros"],
            models=["tiny-qwen2", "tiny-qwen3"])
GENEROUS = "mean:5000%"  # 51 times slower: no shared CPU is that noisy, a saved run made 1000 times faster is


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _bench(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poros", "bench", "matrix", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=_env())


def _suite(tmp_path, matrix: str, results: Path, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={matrix}",
                           f"--results={results}", "-q", "-p", "no:cacheprovider", *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=_env())


def _matrix(tmp_path, **changes) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def _faster(source: Path, target: Path, factor: float = 1000.0) -> Path:
    """`source` with every timing divided by `factor`: a saved run this run cannot come near."""
    data = json.loads(source.read_text())
    for b in data["benchmarks"]:
        s = b["stats"]
        for k in ("min", "max", "mean", "median", "stddev", "iqr", "q1", "q3", "ld15iqr", "hd15iqr", "total"):
            s[k] /= factor
        s["ops"] *= factor
        s["data"] = [t / factor for t in s.get("data", [])]
    target.write_text(json.dumps(data))
    return target


def _names(path: Path) -> list[str]:
    return sorted(b["fullname"] for b in json.loads(path.read_text())["benchmarks"])


# --- the pieces --------------------------------------------------------------------------------------------


def test_earlier_cell_ids_are_read_as_todays():
    old = "suites/test_matrix.py::test_step[model=tiny-qwen2-stack=current-method=poros]"
    assert current_name(old) == "suites/test_matrix.py::test_step[model:tiny-qwen2-stack:current-method:poros]"
    today = "suites/test_matrix.py::test_step[model:qwen3-32b-stack:current-seq_len:512-method:poros-plan:24GB]"
    assert current_name(today) == today
    assert current_name("test_other") == "test_other"


def test_the_committed_cpu_run_is_a_compare_source_for_the_cpu_matrix():
    """pytest-benchmark's own loader reads the committed file, and its benchmarks are the timed cells of
    matrices/cpu.yaml that run on a CPU (unsloth needs a GPU)."""
    from pytest_benchmark.logger import Logger
    from pytest_benchmark.storage.file import FileStorage

    path = REPO / "results" / "cpu" / "benchmark.json"
    storage = FileStorage(REPO / ".benchmarks", logger=Logger(Logger.QUIET, config=None), default_machine_id="x")
    [(_, data)] = list(storage.load(str(path)))
    names = {current_name(b["fullname"]) for b in data["benchmarks"]}
    cells = {f"suites/test_matrix.py::test_step[{c.id}]" for c in matrix_cells(load_matrix("cpu"))
             if c.method is not None and c.method.value != "unsloth"}
    assert names == cells
    assert len(load_compare_source(path)) == len(cells)


def test_a_source_of_another_or_no_pass_length_is_refused():
    """A benchmark round is one pass: rounds of another length, or of one the file does not record (an earlier
    harness's, tests/earlier_harness), compare other work. The control: the same length."""
    from poros.harness.compare import pass_length_problem

    earlier = load_compare_source(REPO / "tests" / "earlier_harness" / "benchmark.json")
    assert "records no pass length (extra_info.steps" in pass_length_problem(earlier, 4)
    bench = {"name": "b", "extra_info": {"steps": 3}}
    assert "its passes ran 3 step(s) each, this run's 4; pass --steps 3" in pass_length_problem([bench], 4)
    assert pass_length_problem([bench, {**bench, "extra_info": {"steps": 4}}], 3).startswith("its passes ran 4")
    assert pass_length_problem([bench], 3) is None


def test_compare_sources_and_thresholds_are_checked(tmp_path):
    with pytest.raises(PorosError, match="no such file"):
        load_compare_source(tmp_path / "missing.json")
    with pytest.raises(PorosError, match="is a folder"):
        load_compare_source(tmp_path)
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(PorosError, match="not a benchmark JSON file"):
        load_compare_source(tmp_path / "text.json")
    (tmp_path / "empty.json").write_text('{"benchmarks": []}')
    with pytest.raises(PorosError, match="holds no benchmarks"):
        load_compare_source(tmp_path / "empty.json")
    (tmp_path / "nostats.json").write_text('{"benchmarks": [{"fullname": "x"}]}')
    with pytest.raises(PorosError, match="benchmark 0 has no fullname or no timing stats"):
        load_compare_source(tmp_path / "nostats.json")
    assert [c.threshold for c in parse_compare_fail(["mean:10%", "min:0.5"])] == [10, 0.5]
    with pytest.raises(ConfigError) as e:
        parse_compare_fail(["mean:5.5%", "max:x", "median:3%"])
    assert e.value.problems[0].startswith("'mean:5.5%': expected FIELD:N%") and len(e.value.problems) == 2


def test_bench_refuses_bad_compare_options_before_any_work(tmp_path, capsys):
    from poros.cli import main
    from tests.fixtures import one_line_refusal

    matrix, out = _matrix(tmp_path, models=["tiny-qwen2"]), tmp_path / "out"
    for extra, named in ((["--benchmark-compare-fail", GENEROUS], "needs --benchmark-compare PATH"),
                         (["--benchmark-compare", str(tmp_path / "none.json")], "none.json: no such file"),
                         (["--benchmark-compare", str(REPO / "results" / "cpu" / "benchmark.json"),
                           "--benchmark-compare-fail", "mean:5.5%"], "'mean:5.5%': expected FIELD:N%"),
                         (["--benchmark-compare", str(REPO / "tests" / "earlier_harness" / "benchmark.json")],
                          "records no pass length")):
        one_line_refusal(capsys, main(["bench", "matrix", str(matrix), "-o", str(out), *extra]), named)
        assert not out.exists()


def test_comparisons_that_would_compare_nothing_are_refused_before_any_cell(tmp_path):
    """pytest-benchmark alone warns and then passes every regression check; the suites refuse in one line."""
    matrix = _matrix(tmp_path, models=["tiny-qwen2"])
    cell = "suites/test_matrix.py::test_step[model:tiny-qwen2-stack:current-method:poros]"
    bench = {"fullname": cell, "stats": {"min": 1.0, "max": 1.0, "mean": 1.0, "median": 1.0, "stddev": 0.0,
                                         "rounds": 1, "iqr": 0.0, "q1": 1.0, "q3": 1.0}, "extra_info": {"steps": 3}}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"machine_info": {}, "benchmarks": [{**bench, "fullname": cell.replace("qwen2", "x"),
                                                                     "extra_info": {"steps": 1}}]}))
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"machine_info": {}, "benchmarks": [{**bench, "extra_info": {}}]}))
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps({"machine_info": {}, "benchmarks": [bench]}))
    results = tmp_path / "r" / "results.jsonl"
    for extra, named in (
            ([f"--benchmark-compare={other}"], "none of its cells is one of the 1 timed cells selected here"),
            ([f"--benchmark-compare={longer}"], "its passes ran 3 step(s) each, this run's 1; pass --steps 3"),
            ([f"--benchmark-compare={unknown}"], "records no pass length (extra_info.steps"),
            ([f"--benchmark-compare={tmp_path / 'missing.json'}"], "missing.json: no such file"),
            ([f"--benchmark-compare-fail={GENEROUS}"], "--benchmark-compare-fail needs --benchmark-compare PATH")):
        proc = _suite(tmp_path, matrix, results, *extra)
        assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert named in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and not results.exists()


# --- end to end ----------------------------------------------------------------------------------------------


@pytest.mark.slow  # `poros bench` end to end, four runs in subprocesses
def test_bench_compares_with_an_earlier_run_and_fails_on_a_regression(tmp_path):
    matrix = _matrix(tmp_path)
    first = tmp_path / "first"
    # the run to compare with, in two parts: its benchmark.json is appended to by --resume
    part = _bench(matrix, "-o", first, "-k", "model:tiny-qwen2")
    assert part.returncode == 0, part.stderr[-3000:]
    rest = _bench(matrix, "-o", first, "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    saved = first / "benchmark.json"
    cells = [f"suites/test_matrix.py::test_step[model:{m}-stack:current-method:poros]" for m in TINY["models"]]
    assert _names(saved) == cells
    fast = _faster(saved, tmp_path / "fast.json")  # for the negative control below

    # the next run in the same folder: the earlier run's benchmark.json is moved aside first, and compared there
    same = _bench(matrix, "-o", first, "--benchmark-compare", saved, "--benchmark-compare-fail", GENEROUS)
    assert same.returncode == 0, same.stderr[-3000:]
    moved = first / "earlier" / "1" / "benchmark.json"
    assert f"compared 2 timed cell(s) with {moved}, against {GENEROUS}: no regression(s)" in same.stderr, same.stderr
    assert _names(moved) == cells and _names(saved) == cells
    log = (first / "bench.log").read_text()
    for model in TINY["models"]:  # pytest-benchmark's table: each cell now and as saved
        row = f"test_step[model:{model}-stack:current-method:poros]"
        assert f"{row} (NOW)" in log, log[-3000:]
        assert any(x.lstrip().startswith(f"{row} (/") and "earlier/1/benchmark)" in x for x in log.splitlines()), \
            log[-3000:]

    # negative control: the saved run made 1000 times faster, the same threshold fails the run
    now = tmp_path / "now"
    slower = _bench(matrix, "-o", now, "--benchmark-compare", fast, "--benchmark-compare-fail", GENEROUS)
    assert slower.returncode == 1, slower.stderr[-3000:]
    assert "2 regression(s)" in slower.stderr and "Traceback" not in slower.stderr, slower.stderr[-3000:]
    lines = [x for x in slower.stderr.splitlines() if x.startswith(f"poros bench: slower than {fast}: ")]
    assert len(lines) == 2 and all("Field 'mean' has failed PercentageRegressionCheck" in x for x in lines), lines
    assert (now / "report.md").is_file() and _names(now / "benchmark.json") == cells  # nothing else lost


@pytest.mark.slow  # the suites end to end in subprocesses
def test_suites_fail_on_a_regression_and_still_append_a_resumed_runs_benchmarks(tmp_path):
    """`pytest suites/`: a regression is exit 1 with pytest-benchmark's lines, not a traceback out of the
    session end, and a resumed run's benchmark.json still gets the earlier part's cells back."""
    matrix = _matrix(tmp_path)
    results = tmp_path / "run" / "results.jsonl"
    saved = results.with_name("benchmark.json")
    part = _suite(tmp_path, matrix, results, "-k", "model:tiny-qwen2")
    assert part.returncode == 0, part.stdout[-3000:]
    fast = _faster(saved, tmp_path / "fast.json")
    data = json.loads(fast.read_text())  # the cell this part runs, as though saved 1000 times faster too
    data["benchmarks"].append({**data["benchmarks"][0],
                               "fullname": data["benchmarks"][0]["fullname"].replace("tiny-qwen2", "tiny-qwen3")})
    fast.write_text(json.dumps(data))
    rest = _suite(tmp_path, matrix, results, "--resume", f"--benchmark-compare={fast}",
                  f"--benchmark-compare-fail={GENEROUS}")
    assert rest.returncode == 1, rest.stdout[-3000:] + rest.stderr[-3000:]
    assert "Performance has regressed" in rest.stdout + rest.stderr and "Traceback" not in rest.stderr
    assert "1 regression(s) past --benchmark-compare-fail; exit status 1" in rest.stdout
    # the earlier part's tiny-qwen2 cell (compared: already in results, not run again) and this part's tiny-qwen3
    assert len(_names(saved)) == 2
    again = _suite(tmp_path, matrix, tmp_path / "again" / "results.jsonl", f"--benchmark-compare={saved}",
                   f"--benchmark-compare-fail={GENEROUS}")
    assert again.returncode == 0, again.stdout[-3000:]
    assert "Performance has regressed" not in again.stdout + again.stderr
