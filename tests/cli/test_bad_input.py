"""Inputs a user can give that end, each, in one line and a non-zero status (or do the right thing): paths that
loop or name nothing, values a row or a setting cannot hold. Each beside a control that runs."""

from __future__ import annotations

import pytest

from poros.cli import main
from tests.fixtures import one_line_refusal
from tests.harness.test_report import fixture_row, write_jsonl


def _usage_error(capsys, argv, named: str) -> None:
    """argparse's refusal: exit 2, its usage and one error line naming `named`, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert named in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("argv", [
    ["report", "r.jsonl", "-o", ""], ["report", "", "-o", "r.md"], ["bench", "matrix", "cpu", "-o", ""],
    ["bench", "status", "cpu", "-o", ""], ["train", "--data", "d.jsonl", "-o", ""],
    ["export", "--merge", "--model", "m", "--adapter", "a", "-o", ""], ["validate", ""],
], ids=["report-o", "report-input", "bench-o", "status-o", "train-o", "export-o", "validate-file"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    _usage_error(capsys, argv, "expected a path, got ''")
    assert list(tmp_path.iterdir()) == [], "nothing written into the current folder"


def test_a_loop_of_symbolic_links_as_a_path_is_one_line(capsys, tmp_path):
    loop = tmp_path / "a"
    loop.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(loop)
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(), fixture_row(method="resident")])
    one_line_refusal(capsys, main(["report", str(loop), "-o", str(tmp_path / "r.md")]),
                     f"results file {loop} is a loop of symbolic links")
    one_line_refusal(capsys, main(["report", str(results), "-o", str(loop)]), f"-o {loop} is a loop")
    one_line_refusal(capsys, main(["bench", "matrix", "cpu", "-o", str(loop)]),
                     f"output folder {loop} is a loop of symbolic links")
    # control: a link to the results file, and a page written through a link to a folder
    (tmp_path / "link.jsonl").symlink_to(results)
    (tmp_path / "pages").mkdir()
    (tmp_path / "to-pages").symlink_to(tmp_path / "pages")
    assert main(["report", str(tmp_path / "link.jsonl"), "-o", str(tmp_path / "to-pages" / "r.md")]) == 0
    assert (tmp_path / "pages" / "r.md").is_file()


# --- rows a page cannot claim ratios from ------------------------------------------------------------


@pytest.mark.parametrize("field,value,named", [
    ("s_per_step_median", float("nan"), "field s_per_step_median: expected a positive finite number or null, got nan"),
    ("s_per_step_median", -1.0, "field s_per_step_median: expected a positive finite number or null, got -1.0"),
    ("s_per_step_median", float("inf"), "field s_per_step_median: expected a positive finite number or null, got inf"),
    ("s_per_step_median", 0, "field s_per_step_median: expected a positive finite number or null, got 0"),
    ("s_per_step_std", float("-inf"), "field s_per_step_std: expected a finite number >= 0 or null, got -inf"),
    ("per_pass_s", [1.0, float("nan")], "field per_pass_s: expected a list of positive finite seconds"),
    ("tokens_per_s", -5.0, "field tokens_per_s: expected a positive finite number or null"),
], ids=["median=nan", "median=-1", "median=inf", "median=0", "std=-inf", "per_pass=nan", "tokens=-5"])
def test_a_row_whose_time_is_not_a_positive_finite_number_is_refused_by_file_line_and_field(
        capsys, tmp_path, field, value, named):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident"), fixture_row(**{field: value})])
    one_line_refusal(capsys, main(["report", str(results), "-o", str(tmp_path / "r.md")]), f"{results}:2: {named}")
    assert not (tmp_path / "r.md").exists()
    write_jsonl(results, [fixture_row(method="resident"), fixture_row()])  # control: the same rows, timed
    assert main(["report", str(results), "-o", str(tmp_path / "r.md")]) == 0
    assert "3.57×" in (tmp_path / "r.md").read_text()  # 1.2345 / 0.3456


def test_a_sweep_page_of_rows_that_predate_the_gate_field_names_the_reference_as_the_reference(tmp_path):
    """`--sweep` over rows without `gate` (an earlier harness's, tests/earlier_harness) renders; the reference's row says it is the gate's
    reference, never "vs resident"; the gated row says what it was held to where the row names it."""
    from tests.cli.test_streams import ROOT

    assert main(["report", str(ROOT / "tests/earlier_harness/results.jsonl"), "-o", str(tmp_path / "s.md"),
                 "--sweep"]) == 0
    page = (tmp_path / "s.md").read_text()
    resident = [x for x in page.splitlines() if "| resident |" in x]
    assert resident and all("PASS (as the gate's reference)" in x for x in resident), resident
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident", gate="resident", parity_steps=3),
                          fixture_row(gate="resident", parity_steps=3)])
    assert main(["report", str(results), "-o", str(tmp_path / "t.md"), "--sweep"]) == 0
    page = (tmp_path / "t.md").read_text()
    assert "| PASS (3 steps, as the gate's reference) |" in page and "| PASS (3 steps, vs resident) |" in page, page


@pytest.mark.parametrize("warmup,said", [(0, "with no warm-up pass"), (1, "after a discarded warm-up pass"),
                                         (2, "after 2 discarded warm-up passes")])
def test_a_page_says_how_many_warm_up_passes_were_discarded(tmp_path, warmup, said):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident", warmup_passes=warmup), fixture_row(warmup_passes=warmup)])
    assert main(["report", str(results), "-o", str(tmp_path / "r.md")]) == 0
    page = (tmp_path / "r.md").read_text()
    assert f"each cell 200 steps × 3 passes {said} in its process" in page, page
    assert ("(no warm-up;" in page) is (warmup == 0)
    assert main(["report", str(results), "-o", str(tmp_path / "s.md"), "--sweep"]) == 0
    assert ("then was timed with no warm-up pass" in (tmp_path / "s.md").read_text()) is (warmup == 0)


# --- settings beyond what the model or the environment can take -------------------------------------


def test_a_lora_rank_above_the_smallest_adapted_dimension_is_refused_naming_both(capsys, tmp_path):
    from tests.cli.test_cli_errors import _matrix

    named = "lora_rank: 65 exceeds tiny-qwen2's smallest adapted dimension, 64 (model.layers.0.self_attn.k_proj)"
    one_line_refusal(capsys, main(["parity", "--model", "tiny-qwen2", "--lora-rank", "65", "--steps", "1",
                                   "--seq-len", "64", "--device", "cpu"]), named)
    one_line_refusal(capsys, main(["bench", "matrix", _matrix(tmp_path, lora_rank=65), "-o", str(tmp_path / "o")]),
                     named)
    assert not (tmp_path / "o").exists()
    one_line_refusal(capsys, main(["plan", "--model", "tiny-qwen2", "--lora-rank", "100000", "--device", "cpu"]),
                     "lora_rank: 100000 exceeds the model's smallest adapted dimension, 64")
    # controls: the largest rank the model takes, and a rank that exceeds only a linear the run does not adapt
    assert main(["plan", "--model", "tiny-qwen2", "--lora-rank", "64", "--device", "cpu"]) == 0
    assert main(["validate", _matrix(tmp_path, lora_rank=65, lora_targets=["q_proj", "o_proj"])]) == 0
    capsys.readouterr()


def test_a_graph_warm_up_count_that_is_not_a_number_names_the_variable(monkeypatch):
    from poros.engine.runtime.graphs import graph_warmup
    from poros.errors import PorosError

    for junk in ("junk", "-1", "1.5"):
        monkeypatch.setenv("POROS_GRAPH_WARMUP", junk)
        with pytest.raises(PorosError, match=f"POROS_GRAPH_WARMUP: expected a whole number >= 0 .* got '{junk}'"):
            graph_warmup()
    monkeypatch.setenv("POROS_GRAPH_WARMUP", "2")  # controls: a count, and the variable unset
    assert graph_warmup() == 2
    monkeypatch.delenv("POROS_GRAPH_WARMUP")
    assert graph_warmup() == 0


def test_importing_the_engine_with_a_junk_graph_warm_up_is_no_error():
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import poros.engine.runtime.graphs"], capture_output=True, text=True,
                          env={**os.environ, "POROS_GRAPH_WARMUP": "junk"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("field,value,named", [
    ("steps", 0, "field steps: expected an integer >= 1 or null, got 0"),
    ("passes", -2, "field passes: expected an integer >= 1 or null, got -2"),
    ("warmup_passes", 1.5, "field warmup_passes: expected an integer >= 0 or null, got 1.5"),
], ids=["steps=0", "passes=-2", "warmup=1.5"])
def test_a_row_whose_protocol_counts_are_not_counts_is_refused(capsys, tmp_path, field, value, named):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident"), fixture_row(**{field: value})])
    one_line_refusal(capsys, main(["report", str(results), "-o", str(tmp_path / "r.md")]), f"{results}:2: {named}")
    write_jsonl(results, [fixture_row(method="resident"), fixture_row(warmup_passes=0)])  # control: 0 warm-ups
    assert main(["report", str(results), "-o", str(tmp_path / "r.md")]) == 0


@pytest.mark.parametrize("title", ["line one\nline two", "   "], ids=["newline", "blank"])
def test_a_title_that_is_not_one_line_is_refused(capsys, tmp_path, title):
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident"), fixture_row()])
    one_line_refusal(capsys, main(["report", str(results), "-o", str(tmp_path / "r.md"), "--title", title]),
                     "--title: expected one line of text")
    assert main(["report", str(results), "-o", str(tmp_path / "r.md"), "--title", "Poros — mine"]) == 0
    assert (tmp_path / "r.md").read_text().startswith("# Poros — mine (")


def test_a_matrix_path_that_is_a_fifo_or_a_device_says_so(capsys, tmp_path):
    import os

    os.mkfifo(tmp_path / "fifo")
    assert main(["validate", str(tmp_path / "fifo"), "/dev/null"]) == 1
    out = capsys.readouterr().out
    assert "is a FIFO (named pipe), not a file" in out and "'/dev/null' is a character device" in out, out
    one_line_refusal(capsys, main(["bench", "matrix", str(tmp_path / "fifo"), "-o", str(tmp_path / "o")]),
                     "is a FIFO (named pipe), not a file")


@pytest.mark.parametrize("size", ["1e400", "0.5", "0.4B"], ids=["overflows", "half-a-byte", "under-a-byte"])
def test_a_vram_budget_that_is_no_whole_positive_byte_count_is_refused(capsys, size):
    one_line_refusal(capsys, main(["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--vram-budget", size]),
                     f"vram_budget: expected a finite size of at least 1 byte, got '{size}'")
    assert main(["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--vram-budget", "1e9"]) == 0  # control


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.5], ids=["inf", "nan", "half"])
def test_a_size_setting_from_yaml_that_is_not_finite_is_refused_by_field(value):
    from poros.sizes import parse_size

    with pytest.raises(ValueError, match=r"expected a finite size of at least 1 byte"):
        parse_size(value)
    assert parse_size(2.0e9) == 2_000_000_000  # control: a float YAML reads for 2e9


def test_a_lora_target_no_decoder_linear_has_is_refused_naming_those_there_are(capsys):
    """peft's own refusal came after the model was built, as a traceback; and a rank over the smallest adapted
    dimension went unchecked where --lora-targets was given (the flag's text read as letters)."""
    one_line_refusal(capsys, main(["parity", "--model", "tiny-qwen2", "--seq-len", "64", "--steps", "1",
                                   "--lora-targets", "nosuch_proj,q_proj"]),
                     "lora_targets: nosuch_proj is no linear of tiny-qwen2's decoder layers (they have down_proj")
    one_line_refusal(capsys, main(["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--lora-targets", "q_proj,v_proj",
                                   "--lora-rank", "100000"]), "lora_rank: 100000 exceeds tiny-qwen2's smallest")
    assert main(["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--lora-targets", "q_proj,v_proj"]) == 0  # control


@pytest.mark.parametrize("n", ["0", "100000000"])
def test_a_token_count_out_of_range_names_the_range(capsys, tmp_path, n):
    one_line_refusal(capsys, main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", n]),
                     f"--max-new-tokens: expected an integer from 1 to 1048576, got {n}")
    # control: a count in range passes this check, and the empty folder is refused as no checkpoint instead
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "5"])
    assert code == 2 and "--max-new-tokens" not in capsys.readouterr().err


@pytest.mark.parametrize("column, value", [("poros_s_step_median", "abc"), ("resident_s_step", "-1"),
                                           ("unsloth_vram_gb", "inf")])
def test_a_reference_figure_that_is_no_positive_number_is_refused_by_line_and_column(capsys, tmp_path, column, value):
    import csv
    import io

    from poros.harness.report.rows import OFFICIAL_REFERENCE

    lines = OFFICIAL_REFERENCE.read_text().splitlines(keepends=True)
    comments = [x for x in lines if x.startswith("#")]
    rows = list(csv.reader(x for x in lines if not x.startswith("#")))
    rows[1][rows[0].index(column)] = value
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    (tmp_path / "ref.csv").write_text("".join(comments) + out.getvalue())
    results = tmp_path / "results.jsonl"
    write_jsonl(results, [fixture_row(method="resident"), fixture_row()])
    argv = ["report", str(results), "-o", str(tmp_path / "r.md"), "--reference"]
    one_line_refusal(capsys, main(argv + [str(tmp_path / "ref.csv")]),
                     f"ref.csv:{len(comments) + 2}: column {column}: expected a positive number or nothing, got ")
    assert main(argv + [str(OFFICIAL_REFERENCE)]) == 0  # control: the figures as shipped


def test_an_allocation_torch_cannot_make_is_one_line_naming_what_to_lower(capsys, monkeypatch):
    """`poros parity --batch-size 100000000` on the CPU: torch's allocator refuses 51 GB with a RuntimeError."""
    import poros.cli.env as env

    def refuse(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 51200000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(env, "run", refuse)
    assert main(["env"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("poros env: error: out of host memory (an allocation of 51200000000 bytes); lower --batch-size, "
                   "--seq-len or --grad-accum, or use a machine with more memory"), err
    OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {})
    monkeypatch.setattr(env, "run", lambda args: (_ for _ in ()).throw(OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB")))
    assert main(["env"]) == 1
    assert "out of device memory (an allocation of 2.00 GiB)" in capsys.readouterr().err
    monkeypatch.setattr(env, "run", lambda args: (_ for _ in ()).throw(RuntimeError("a kernel failed")))
    with pytest.raises(RuntimeError, match="a kernel failed"):  # control: any other error is not dressed as memory
        main(["env"])


@pytest.mark.parametrize("name", ["", "../../etc", "a b", "-k"], ids=["empty", "path", "space", "dash-first"])
def test_a_matrix_name_that_is_no_file_name_is_refused(capsys, tmp_path, name):
    """A run's rows and `poros bench status` find a matrix again by its name (matrices/NAME.yaml)."""
    import yaml

    from tests.suite_runs import TINY

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**TINY, "name": name, "methods": ["poros"], "models": ["tiny-qwen2"]}))
    assert main(["validate", str(path)]) == 1
    assert "name: expected a matrix name of letters, digits, '-', '_', '.' or '+'" in capsys.readouterr().out
    path.write_text(yaml.safe_dump({**TINY, "name": "cpu-v2.1+x", "methods": ["poros"], "models": ["tiny-qwen2"]}))
    assert main(["validate", str(path)]) == 0  # control


@pytest.mark.parametrize("name", ["results.jsonl", "passes.jsonl"])
@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_record_file_that_is_a_folder_or_fifo_is_refused_not_read_as_no_rows(capsys, tmp_path, name, kind):
    """`poros bench status` read such a run as "not started"; `poros bench matrix --resume` waited forever on a
    FIFO."""
    import os

    from poros.harness.results import ResultsFileError, ResultsWriter

    path = tmp_path / name
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    said = "is a folder" if kind == "folder" else "is a FIFO (named pipe)"
    one_line_refusal(capsys, main(["bench", "status", "cpu", "-o", str(tmp_path)]), f"{path} {said}")
    with pytest.raises(ResultsFileError, match="expected a results file"):
        ResultsWriter(path).repair()
    path.rmdir() if kind == "folder" else path.unlink()
    path.write_text("")  # control: the file, empty, reads as no records
    assert ResultsWriter(path).rows() == [] and main(["bench", "status", "cpu", "-o", str(tmp_path)]) == 0
