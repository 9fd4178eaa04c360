"""Bad input as a new user gives it: one line on stderr (exit 2) before any work, never a traceback;
and `poros bench` as it is meant to be seen: one line per cell, the full log in OUT/bench.log, the
report last, earlier results kept, one run per folder, Ctrl-C saying how to resume."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from poros.cli import main
from poros.common.folders import LOCK_NAME
from tests.fixtures import TINY_MATRIX, one_line_refusal, tiny_matrix
from tests.harness.test_report import fixture_row, write_jsonl

REPO = Path(__file__).resolve().parents[2]
TINY, _matrix = TINY_MATRIX, tiny_matrix


def _refused(capsys, argv, *named) -> str:
    return one_line_refusal(capsys, main(argv), *named)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --- refused before any work: nothing is written -----------------------------------------------


@pytest.mark.parametrize("flags,named", [
    (["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
    (["--passes", "0"], "--passes: expected an integer >= 1, got 0"),
    (["--parity-steps", "0"], "--parity-steps: expected an integer >= 1, got 0"),
    (["--parity-steps", "-1"], "--parity-steps: expected an integer >= 1, got -1"),
    (["-k", "qwen and (poros"], "-k 'qwen and (poros': not a valid selection"),
    (["--reference", "missing.csv"], "missing.csv: no such reference file"),
], ids=["steps=0", "passes=0", "parity-steps=0", "parity-steps=-1", "k=unbalanced", "reference=missing"])
def test_bench_refuses_bad_flags_before_writing_anything(capsys, tmp_path, flags, named):
    out = tmp_path / "out"
    _refused(capsys, ["bench", "matrix", _matrix(tmp_path), "-o", str(out), *flags], named)
    assert not out.exists()


def test_bench_on_a_matrix_asking_for_cuda_without_it_is_one_line(capsys, tmp_path, no_cuda):
    out = tmp_path / "out"
    m = _matrix(tmp_path, device="cuda")
    _refused(capsys, ["bench", "matrix", m, "-o", str(out)], f"{m}: device: cuda requested", "CPU-only build")
    assert not out.exists()


def test_bench_refuses_seq_len_beyond_a_models_positions(capsys, tmp_path):
    _refused(capsys, ["bench", "matrix", _matrix(tmp_path, seq_len=4096), "-o", str(tmp_path / "o")],
             "seq_len: 4096 exceeds tiny-qwen2's max_position_embeddings (2048)")


@pytest.mark.parametrize("changes,named", [
    ({"stacks": [{"name": "old", "torch": "0.0.1", "transformers": "0.0.1", "bitsandbytes": "0.0.1"}]},
     "no cell can run here: stack old needs torch 0.0.1"),
    ({"models": ["qwen2.5-72b"]}, "no cell can run here: qwen2.5-72b has 72.7B parameters: run it on a GPU"),
], ids=["stacks=all-pinned-elsewhere", "models=all-too-big-for-cpu"])
def test_bench_refuses_a_matrix_with_no_cell_runnable_here(capsys, tmp_path, changes, named):
    out = tmp_path / "out"
    _refused(capsys, ["bench", "matrix", _matrix(tmp_path, **changes), "-o", str(out)], named)
    assert not out.exists()


@pytest.mark.parametrize("changes,where", [({"gpus": 64}, "gpus"), ({"sweep": {"gpus": [1, 64]}}, "sweep.gpus")],
                         ids=["gpus=64", "sweep-gpus=64"])
def test_bench_refuses_more_ranks_than_the_host_takes_before_any_starts(capsys, tmp_path, monkeypatch, changes, where):
    """`gpus: 64` on a two-core machine: one line naming the count, the cores and the most it takes; no rank
    started, nothing written (tests/harness/test_preflight.py holds the limit itself to a count that runs)."""
    import poros.harness.preflight
    import poros.harness.ranks

    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(poros.harness.preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(poros.harness.ranks, "run_ranks", no_ranks)
    out, m = tmp_path / "out", _matrix(tmp_path, **changes)
    _refused(capsys, ["bench", "matrix", m, "-o", str(out)], f"{m}: {where}: 64 data-parallel ranks on the CPU",
             "2 CPU core(s)", "set gpus to 8 or less")
    assert not out.exists()


def test_bench_refuses_an_output_path_that_is_a_file(capsys, tmp_path):
    f = tmp_path / "out.txt"
    f.write_text("keep me\n")
    _refused(capsys, ["bench", "matrix", _matrix(tmp_path), "-o", str(f)], f"{f} is a file")
    _refused(capsys, ["bench", "matrix", _matrix(tmp_path), "-o", str(f / "sub")], str(f / "sub"))
    assert f.read_text() == "keep me\n"


@pytest.mark.parametrize("argv,named", [
    (["build", "--model", "tiny-qwen2", "--device", "cuda"], "--device: cuda requested"),
    (["parity", "--model", "tiny-qwen2", "--device", "cuda", "--steps", "1"], "--device: cuda requested"),
    (["build", "--model", "tiny-qwen2", "--device", "gpu"], "--device: expected cpu, cuda or cuda:N, got 'gpu'"),
    (["parity", "--model", "tiny-qwen2", "--seq-len", "4096", "--steps", "1"], "exceeds tiny-qwen2's max_position"),
    (["parity", "--model", "tiny-qwen2", "--steps", "0"], "steps: expected an integer > 0, got 0"),
    (["build", "--model", "./no-such-checkpoint"], "'./no-such-checkpoint' does not exist"),
    (["plan", "--model", "tiny-qwen2", "--vram-budget", "auto"], "--vram-budget auto measures the free memory"),
    (["parity", "--model", "tiny-qwen2", "--seq-len", "1", "--steps", "1"], "seq_len: expected an integer >= 2"),
], ids=["build-device=cuda", "parity-device=cuda", "build-device=gpu", "parity-seq-len=4096", "parity-steps=0",
        "build-model=missing-folder", "plan-vram-budget=auto", "parity-seq-len=1"])
def test_commands_refuse_bad_input_in_one_line(capsys, no_cuda, argv, named):
    _refused(capsys, argv, named)


def test_a_model_path_that_is_a_file_says_so_not_unknown_name(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    for argv in (["plan", "--model", str(weights)], ["parity", "--model", str(weights), "--steps", "1"]):
        _refused(capsys, argv, f"model {str(weights)!r} is a file; expected a checkpoint folder")
    _refused(capsys, ["plan", "--model", "gpt-17"], "unknown model 'gpt-17'")  # a name, not a path


def test_a_bench_matrix_that_is_binary_or_a_folder_is_one_line(capsys, tmp_path):
    binary = tmp_path / "m.yaml"
    binary.write_bytes(b"name: x\n\x89\xff\x00")
    _refused(capsys, ["bench", "matrix", str(binary), "-o", str(tmp_path / "o")], str(binary), "not UTF-8")
    _refused(capsys, ["bench", "matrix", str(tmp_path), "-o", str(tmp_path / "o")], "is a folder")


def test_validate_names_seq_len_beyond_positions_and_binary_files(capsys, tmp_path):
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    code = main(["validate", _matrix(tmp_path, seq_len=4096), str(binary), str(REPO / "matrices" / "cpu.yaml")])
    out, err = capsys.readouterr()
    assert code == 1 and err == "" and "Traceback" not in out
    assert "  - seq_len: 4096 exceeds tiny-qwen2's max_position_embeddings (2048); use seq_len <= 2048" in out, out
    assert "not UTF-8" in out and f"ok   {REPO / 'matrices' / 'cpu.yaml'}" in out, out


def test_validate_runs_the_planners_checks_as_plan_does(capsys, tmp_path):
    """A budget below the smallest plan fails every poros cell: validate says so in the planner's own words
    (those `poros plan` refuses the same settings with), for the matrix's budget and for a plan's; bench
    refuses before writing anything; a budget that fits is ok (control)."""
    said = _refused(capsys, ["plan", "--model", "tiny-qwen2", "--device", "cpu", "--seq-len", "64", "--lora-rank",
                             "4", "--block-size", "2", "--vram-budget", "1MB"],
                    "vram_budget 1 MB is below the smallest plan").removeprefix("poros plan: error: ")
    small = _matrix(tmp_path, vram_budget="1MB")
    assert main(["validate", small]) == 1
    assert f"  - tiny-qwen2: {said}" in capsys.readouterr().out
    plans = _matrix(tmp_path, plans={"streamed": {}, "tiny": {"vram_budget": "1MB"}, "ok": {"vram_budget": "1GB"}})
    assert main(["validate", plans]) == 1
    out = capsys.readouterr().out
    assert f"  - tiny-qwen2 (plan tiny): {said}" in out and "plan ok" not in out and "plan streamed" not in out, out
    _refused(capsys, ["bench", "matrix", small, "-o", str(tmp_path / "o")], "tiny-qwen2: vram_budget 1 MB is below")
    assert not (tmp_path / "o").exists()
    assert main(["validate", _matrix(tmp_path, vram_budget="1GB")]) == 0
    assert main(["validate", _matrix(tmp_path, vram_budget="auto")]) == 1  # on a cpu matrix: no GPU to measure
    assert "tiny-qwen2: vram_budget auto needs a CUDA device to measure its free memory" in capsys.readouterr().out
    assert main(["validate", _matrix(tmp_path, vram_budget="auto", device="cuda")]) == 0  # the run's GPU measures it


def test_validate_refuses_what_a_matrix_lists_twice(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "sub").mkdir()
    twice = _matrix(tmp_path, models=["tiny-qwen2", str(ckpt), "tiny-qwen2", f"{tmp_path}/sub/../ckpt"],
                    methods=["poros", "resident", "poros"], stacks=["current", "current"])
    assert main(["validate", twice]) == 1
    out = capsys.readouterr().out
    for needle in ("models: 'tiny-qwen2' is listed twice", f"(as {str(ckpt)!r} too)", "methods: poros is listed twice",
                   "stacks: current is listed twice"):
        assert needle in out, out
    assert main(["validate", _matrix(tmp_path)]) == 0  # control: each once


# --- reports: never over their input, binary files in one line -------------------------------------


def test_report_never_writes_over_its_input(capsys, tmp_path):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(), fixture_row(method="resident")])
    before = results.read_bytes()
    _refused(capsys, ["report", str(results), "-o", str(results)], "would write over the input", str(results))
    assert results.read_bytes() == before
    assert main(["report", str(results), "-o", str(tmp_path / "report.md")]) == 0  # control
    assert results.read_bytes() == before and (tmp_path / "report.md").read_text().startswith("# Poros")


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\xff", "résumé".encode("latin-1")],
                         ids=["binary", "latin-1"])
def test_report_of_a_non_utf8_results_file_is_one_line(capsys, tmp_path, content):
    results = tmp_path / "results.jsonl"
    results.write_bytes(content)
    _refused(capsys, ["report", str(results), "-o", str(tmp_path / "r.md")], str(results), "not UTF-8")


@pytest.mark.parametrize("content,named", [
    (b"\x89\x00\xff binary", "not a CSV file (byte 0 is not UTF-8 text)"),
    (b'a,b\n1,2,3,4\n"open', "not a readable CSV"),
    (b"a,b\n1,2\n", "missing column(s) hardware"),
], ids=["binary", "unparseable", "other-columns"])
def test_report_with_a_bad_reference_is_one_line(capsys, tmp_path, content, named):
    results, ref = tmp_path / "results.jsonl", tmp_path / "ref.csv"
    write_jsonl(results, [fixture_row()])
    ref.write_bytes(content)
    _refused(capsys, ["report", str(results), "-o", str(tmp_path / "r.md"), "--reference", str(ref)], named)
    assert not (tmp_path / "r.md").exists()


def test_report_given_folders_is_one_line(capsys, tmp_path):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row()])
    _refused(capsys, ["report", str(tmp_path), "-o", str(tmp_path / "r.md")], "is a folder")
    _refused(capsys, ["report", str(results), "-o", str(tmp_path)], "is a folder")


# --- one run per folder ---------------------------------------------------------------------


def test_a_second_bench_into_a_busy_folder_is_refused_and_touches_nothing(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("the first run's rows\n")
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from poros.common.folders import OutputLock; "
            f"OutputLock({str(out)!r}, command='poros bench matrix cpu -o out').acquire(); "
            f"print('locked', flush=True); time.sleep(120)")
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "locked"
        _refused(capsys, ["bench", "matrix", _matrix(tmp_path), "-o", str(out)],
                 f"output folder {out} is in use by another run: pid {first.pid}", "pass another -o")
    finally:
        first.kill()
        first.wait()
    assert (out / "results.jsonl").read_text() == "the first run's rows\n"
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, "results.jsonl"]


def test_a_selected_model_that_does_not_fit_is_refused_by_the_suites_in_one_line(capfd, tmp_path, monkeypatch):
    """With -k the suites check the models the selection builds, after collecting it (before any
    cell), and `poros bench` relays their refusal from its log as its own one line."""
    import poros.store.host_memory

    monkeypatch.setattr(poros.store.host_memory, "available_host_memory", lambda: 1000)
    out = tmp_path / "out"
    code = main(["bench", "matrix", _matrix(tmp_path), "-o", str(out), "-k", "tiny-qwen2 and poros"])
    stdout, stderr = capfd.readouterr()
    lines = stderr.strip().splitlines()
    assert code == 2 and stdout == "", stderr
    assert len(lines) == 1 and lines[0].startswith("poros bench: error: building tiny-qwen2 needs about"), lines
    assert not (out / "results.jsonl").exists() and not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("keyword", ["nosuchcell", "tiny-qwen2 and not (poros or resident or parity)"],
                         ids=["no-such-word", "all-excluded"])
def test_a_selection_of_no_cell_changes_nothing_in_out(capfd, tmp_path, keyword):
    """`-k` that matches no cell is refused before OUT is touched: an earlier run's files stay where and as they are
    (not moved to earlier/N/), no bench.log, no lock; a folder that did not exist is not made."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_bytes(b'{"an earlier run": "rows"}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    m = _matrix(tmp_path)
    for folder in (out, tmp_path / "new"):
        code = main(["bench", "matrix", m, "-o", str(folder), "-k", keyword])
        stdout, stderr = capfd.readouterr()
        assert code == 1 and stdout == "" and stderr == (
            f"poros bench: no cell matched -k {keyword!r} (cell ids read like "
            "model:tiny-qwen2-stack:current-gate:parity)\n"), stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not (tmp_path / "new").exists()


def test_a_selection_that_matches_runs_and_keeps_the_earlier_run(capfd, tmp_path):
    """Control: the same folder with a -k that matches a cell runs it: the earlier run moves to earlier/1/, the log
    and the new rows are written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_bytes(b'{"an earlier run": "rows"}\n')
    code = main(["bench", "matrix", _matrix(tmp_path), "-o", str(out), "-k", "method:resident"])
    _, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    assert (out / "earlier" / "1" / "results.jsonl").read_bytes() == b'{"an earlier run": "rows"}\n'
    assert (out / "bench.log").is_file() and '"method": "resident"' in (out / "results.jsonl").read_text()


@pytest.mark.parametrize("changes, where", [({"gpus": 64}, "gpus"), ({"sweep": {"gpus": [1, 64]}}, "sweep.gpus")],
                         ids=["gpus=64", "sweep.gpus=64"])
def test_validate_and_bench_refuse_more_cpu_ranks_than_the_host_takes_in_the_same_words(capsys, tmp_path, monkeypatch,
                                                                                         changes, where):
    """One rule (`preflight.cpu_rank_problems`, read by `check_matrix`): `poros validate` fails the file naming the
    same problem `poros bench` refuses it with, before any rank starts or anything is written."""
    from poros.harness import preflight

    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    problem = (f"{where}: 64 data-parallel ranks on the CPU are 64 processes; this host gives this process 2 CPU "
               f"core(s), and a CPU run takes at most {preflight.CPU_RANKS_PER_CORE} ranks a core: set gpus to "
               f"{2 * preflight.CPU_RANKS_PER_CORE} or less")
    m = _matrix(tmp_path, **changes)
    assert main(["validate", m]) == 1
    assert capsys.readouterr().out == f"FAIL {m}:\n  - {problem}\n"
    out = tmp_path / "out"
    _refused(capsys, ["bench", "matrix", m, "-o", str(out)], f"poros bench: error: {m}: {problem}")
    assert not out.exists()


def test_validate_passes_a_cpu_matrix_of_two_ranks(capsys, tmp_path, monkeypatch):
    """Control: two ranks on two cores are within the rule."""
    from poros.harness import preflight

    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    m = _matrix(tmp_path, gpus=2)
    assert main(["validate", m]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.startswith(f"ok   {m}: ")


# --- the bench end to end (subprocesses: it redirects file descriptors) -----------------------------


def _bench(*argv, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poros", "bench", "matrix", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600, **kw)


@pytest.mark.slow  # `poros bench` in a subprocess
def test_resume_into_a_folder_with_nothing_recorded_says_it_starts_afresh(tmp_path):
    """The first part of a run in parts, or a mistyped -o: announced in one line, not a silent fresh run."""
    out = tmp_path / "typo"
    run = _bench(_matrix(tmp_path), "-o", str(out), "--resume", "-k", "method:resident")
    assert f"--resume: nothing recorded in {out} yet; the run starts at its first cell" in run.stderr, run.stderr


@pytest.mark.slow  # `poros bench` end to end in a subprocess
def test_bench_is_quiet_keeps_earlier_results_and_resumes_past_a_torn_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text("an earlier run's rows\n")
    (out / "report.md").write_text("an earlier report\n")
    m = _matrix(tmp_path)
    run = _bench(m, "-o", str(out), "--parity-steps", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    err = run.stderr.splitlines()
    assert err[0] == f"kept the earlier run's results.jsonl, report.md in {out / 'earlier' / '1'}/", err
    cells = [line for line in err if line.startswith("[cell ")]
    assert [c.split(":")[0] for c in cells] == ["[cell 1/3] tiny-qwen2 parity gate", "[cell 2/3] tiny-qwen2 resident",
                                                "[cell 3/3] tiny-qwen2 poros"], err
    assert "parity PASS" in cells[0] and "2 steps" in cells[0] and "s/step" in cells[1] and "s/step" in cells[2]
    # kept, the settings each method runs (a heading, a line a method), 3 cells, summary, wrote: no per-step losses,
    # warnings or tables
    assert err[1].startswith("settings (") and len(err) <= 9, err
    both = run.stdout + run.stderr
    for noise in ("loss", "Warning", "kernels-community", "Name (time in", "passed, "):
        assert noise not in both, noise
    assert run.stdout.strip() == (out / "report.md").read_text().strip()  # the report comes last, on stdout
    log = (out / "bench.log").read_text()
    assert "loss" in log and "Name (time in" in log and "3 passed" in log  # the full log is kept
    assert (out / "earlier" / "1" / "results.jsonl").read_text() == "an earlier run's rows\n"
    assert (out / "earlier" / "1" / "report.md").read_text() == "an earlier report\n"
    assert not (out / LOCK_NAME).exists()
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["resident", "poros"]  # the reference first: poros's floor reads its step
    assert all(r["parity_steps"] == 2 and r["parity"] == "PASS" for r in rows)  # --parity-steps 2 over the matrix's 1

    # killed while writing the poros row: its lock file is left behind, its last line torn; resume
    # takes the folder over, keeps the resident row and sets the partial line aside
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": int(gone.stdout), "host": os.uname().nodename,
                                             "started": "2026-01-01T00:00:00+00:00", "command": "poros bench"}))
    torn = json.dumps(rows[1])[:60]
    (out / "results.jsonl").write_text(json.dumps(rows[0]) + "\n" + torn)
    again = _bench(m, "-o", str(out), "--parity-steps", "2", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"was left by pid {gone.stdout.strip()} on host" in again.stderr, again.stderr
    assert f"{out / 'results.jsonl'}:2 is a partial row" in again.stderr, again.stderr
    assert "tiny-qwen2 resident: skipped: already in results (--resume)" in again.stderr, again.stderr
    assert "nothing recorded" not in again.stderr, again.stderr
    assert (out / "results.jsonl.torn").read_text() == torn + "\n"
    resumed = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert resumed[0] == rows[0] and [r["method"] for r in resumed] == ["resident", "poros"]
    names = sorted(b["name"] for b in json.loads((out / "benchmark.json").read_text())["benchmarks"])
    # the first run's resident benchmark kept beside the resumed run's poros one (it was overwritten before)
    assert len(names) == 2 and "method:poros" in names[0] and "method:resident" in names[1], names
    assert (out / "bench.log").read_text().startswith(log)  # the log goes on


@pytest.mark.slow  # `poros bench` end to end in a subprocess
def test_ctrl_c_says_how_to_resume(tmp_path):
    out = tmp_path / "out"
    m = _matrix(tmp_path, steps=400)
    proc = subprocess.Popen([sys.executable, "-m", "poros", "bench", "matrix", m, "-o", str(out)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "bench.log").is_file() or "[cell 2/3]" not in (out / "bench.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and stdout == ""
    assert "tiny-qwen2 resident: interrupted" in stderr, stderr
    command = stderr.strip().splitlines()[-1].strip()
    words = shlex.split(command)
    assert words[words.index("poros") - 1 :] == ["-m", "poros", "bench", "matrix", m, "-o", str(out), "--resume"]
    assert not (out / LOCK_NAME).exists()


def test_the_suites_refuse_zero_counts_when_run_directly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pytest", str(REPO / "suites"), f"--matrix={_matrix(tmp_path)}",
                           f"--results={tmp_path / 'r' / 'results.jsonl'}", "--parity-steps=0", "-q",
                           "-p", "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--parity-steps: expected an integer >= 1, got 0" in proc.stderr
    assert not (tmp_path / "r" / "results.jsonl").exists()


def test_one_process_commands_refuse_to_run_under_torchrun(monkeypatch, capsys):
    """Under torchrun every rank would train the same data into one output folder: only `parity` runs
    as a rank; the others stop with one line naming what does run data-parallel."""
    from poros.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["plan", "--model", "tiny-qwen3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("poros plan: error: runs as one process, not under torchrun") and "gpus: N" in err
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc-per-node 1: one process after all
    assert main(["plan", "--model", "tiny-qwen3"]) == 0


# --- poros train: one run per folder, SIGTERM from outside ------------------------------------------


def _wait_for(what: str, ready, proc, timeout: float = 300) -> None:
    """Wait until `ready()` (a state of the run), failing early if the process ended."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def test_a_second_train_into_a_busy_folder_is_refused_and_sigterm_checkpoints(capsys, tmp_path):
    """A run owns its folder: a second one is refused naming the first (pid and command). SIGTERM then
    stops the first like Ctrl-C: a checkpoint, the resume command, exit 143. Both wait for the state they
    need (a logged step), never for a time."""
    from poros.finetune.samples import generated_texts, write_jsonl
    from tests.fixtures import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "ckpt", "tiny-qwen2", generated_texts(100))
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in generated_texts(80)])
    out = tmp_path / "run"
    argv = ["train", "--model", str(ckpt), "--data", str(data), "--out", str(out), "--seq-len", "64",
            "--device", "cpu", "--save-every", "0"]
    first = subprocess.Popen([sys.executable, "-m", "poros", *argv, "--steps", "100000"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = out / "log.csv"
        _wait_for("a logged step", lambda: log.is_file() and len(log.read_text().splitlines()) > 1, first)
        capsys.readouterr()
        _refused(capsys, [*argv, "--steps", "3"], f"output folder {out} is in use by another run: pid "
                 f"{first.pid}", "--steps 100000", "pass another --out")
        assert (out / LOCK_NAME).is_file()
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 143, stderr[-3000:]
    assert "SIGTERM: saving a checkpoint" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert json.loads(stdout.strip().splitlines()[-1])["interrupted"] is True
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] >= 1
    assert "resume with:" in stderr and stderr.strip().splitlines()[-1].strip().endswith("--resume")
    assert not (out / LOCK_NAME).exists()


def test_the_run_log_reads_back_its_lines_after_its_file_is_removed(tmp_path):
    """A run whose output folder is removed under it (a checkout refreshed around a run in the background) still
    reads its own lines back at its end, where it looks for a refusal's line; the control reads them with the file
    in place."""
    from poros.cli.bench import RunLog

    for remove in (False, True):
        path = tmp_path / f"bench-{remove}.log"
        path.write_text("an earlier run\n")
        with RunLog(path) as log:
            os.write(1, b"ERROR: the line to relay\n")
            if remove:
                path.unlink()
            lines = log.since_start()
        assert lines == ["ERROR: the line to relay"], (remove, lines)
        assert path.exists() is not remove
