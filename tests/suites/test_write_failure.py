"""A run whose records cannot be written (a full disk, a file-size limit) stops at the first that fails, in one
line naming it (exit 74), with every finished pass and row whole; `--resume` once there is room ends the run with
each pass counted once. The limit is real: the suites run in a process whose files may not grow past it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.suite_runs import REPO, TINY, result_rows

pytestmark = pytest.mark.slow  # the suites end to end in subprocesses

MATRIX = {**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2"], "parity_steps": 1}


def _suites(tmp_path, *extra, limit: int | None = None) -> subprocess.CompletedProcess:
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(MATRIX))
    argv = [str(REPO / "suites"), f"--matrix={path}", f"--results={tmp_path / 'out' / 'results.jsonl'}", "-q",
            "-p", "no:cacheprovider", *extra]
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            + (f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
               if limit else "")
            + f"import pytest\nsys.exit(pytest.main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})


def test_a_record_past_the_file_size_limit_stops_the_run_and_resume_counts_each_pass_once(tmp_path):
    out = tmp_path / "out"
    first = _suites(tmp_path, limit=5000)  # a results row is 3 KB: the second does not fit, nor the benchmark's
    assert first.returncode == 74, first.stdout[-3000:] + first.stderr[-2000:]
    said = [x for x in first.stdout.splitlines() if "cannot write " in x and "the run stopped there" in x]
    assert said and f" {out}/" in said[0] and "(File too large); raise the file-size limit (ulimit -f)" in said[0], \
        first.stdout[-3000:]
    for name in ("results.jsonl", "passes.jsonl"):  # whole lines only, none cut
        text = (out / name).read_text() if (out / name).exists() else ""
        assert text == "" or text.endswith("\n")
        [json.loads(x) for x in text.splitlines()]
    assert not list(out.glob(".*partial*")), "no temporary left behind"
    second = _suites(tmp_path, "--resume")  # control: with room, the same run ends
    assert second.returncode == 0, second.stdout[-3000:]
    rows = result_rows(out / "results.jsonl")
    assert sorted(r["method"] for r in rows) == ["poros", "resident"]
    assert all(len(r["per_pass_s"]) == MATRIX["passes"] for r in rows)
    passes = [(r["cell"], r["index"]) for r in result_rows(out / "passes.jsonl") if r["kind"] == "pass"]
    assert sorted(passes) == sorted(set(passes)) and len(passes) == 2 * MATRIX["passes"], passes
