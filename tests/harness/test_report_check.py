"""`poros report --check-against`: a run's page held to the committed page of its matrix. Protocol and parity must
match cell by cell (each difference one line naming the cell, exit 1); a slowdown outside the band is a warning."""

from __future__ import annotations

import copy

import pytest

from poros.cli import main
from poros.harness.report import load_results
from poros.harness.report.check import RATIO_BAND, check_against
from tests.harness.test_report import cpu_row, write_jsonl

MODELS = ("tiny-qwen2", "tiny-qwen3")


def page_rows() -> list[dict]:
    """A CPU page's rows: poros and resident of two tiny models (every number made up)."""
    return [cpu_row(model=m, method=meth) for m in MODELS for meth in ("poros", "resident")]


def check(tmp_path, run: list[dict], committed: list[dict] | None = None, band: float = RATIO_BAND):
    a = load_results(write_jsonl(tmp_path / "run.jsonl", run))
    b = load_results(write_jsonl(tmp_path / "committed.jsonl", committed or page_rows()))
    return check_against(a, b, band)


def test_the_same_rows_match(tmp_path):
    found = check(tmp_path, page_rows())
    assert found.problems == [] and found.warnings == [] and found.cells == 4


def _changed(index: int, **kw) -> list[dict]:
    rows = copy.deepcopy(page_rows())
    for k, v in kw.items():
        if k in ("config", "provenance"):
            rows[index][k].update(v)
        else:
            rows[index][k] = v
    return rows


CHANGES = {  # one field of one cell changed in the run, and the line that names it
    "steps": (_changed(0, steps=3), "tiny-qwen2 poros: steps 3 in this run, 200 on the committed page"),
    "passes": (_changed(1, passes=1), "tiny-qwen2 resident: passes 1 in this run, 3 on the committed page"),
    "warm-up": (_changed(2, warmup_passes=0), "tiny-qwen3 poros: warmup_passes 0 in this run, 1 on the committed page"),
    "setting": (_changed(0, config={"seq_len": 64}), "tiny-qwen2 poros: seq_len 64 in this run, 512 on the committed page"),
    "block": (_changed(0, config={"block_size": 2}), "tiny-qwen2 poros: block_size 2 in this run, 4 on the committed page"),
    "stack": (_changed(3, stack="torch 2.13.0+cpu / transformers 5.25.0"),
              "tiny-qwen3 resident: stack torch 2.13.0+cpu / transformers 5.25.0 in this run, torch 2.11.0+cu130 / "
              "transformers 5.17.0 on the committed page"),
    "bitsandbytes": (_changed(0, provenance={"versions": {**cpu_row()["provenance"]["versions"], "bitsandbytes": "0.50.2"}}),
                     "tiny-qwen2 poros: bitsandbytes 0.50.2 in this run, 0.49.2 on the committed page"),
    "parity": (_changed(2, parity="FAIL", parity_max_abs_diff=1e-3),
               "tiny-qwen3 poros: parity FAIL (1.00e-03) in this run, PASS (0.00e+00) on the committed page"),
    "missing": (page_rows()[:-1], "tiny-qwen3 resident: on the committed page, not in this run"),
    "extra": (page_rows() + [cpu_row(model="tiny-gemma3", method="poros")],
              "tiny-gemma3 poros: in this run, not on the committed page"),
}


@pytest.mark.parametrize("case", CHANGES, ids=lambda c: f"change={c}")
def test_each_difference_is_one_problem_naming_its_cell(tmp_path, case):
    run, line = CHANGES[case]
    assert check(tmp_path, run).problems == [line]


def test_a_slowdown_outside_the_band_is_a_warning_not_a_problem(tmp_path):
    """poros twice as slow against the same resident: +100% warns at ±25%; the control, +10%, is quiet, and so is
    the same run under a band of ±150%."""
    slow = _changed(0, s_per_step_median=2 * page_rows()[0]["s_per_step_median"])
    found = check(tmp_path, slow)
    assert found.problems == [] and len(found.warnings) == 1
    assert found.warnings[0].startswith("tiny-qwen2 poros: slowdown vs resident 7.14× in this run, 3.57× on the "
                                        "committed page (+100%, outside ±25%)")
    near = _changed(0, s_per_step_median=1.1 * page_rows()[0]["s_per_step_median"])
    assert check(tmp_path, near).warnings == [] and check(tmp_path, slow, band=1.5).warnings == []


def test_the_cli_exits_1_naming_the_cell_and_0_on_a_match(tmp_path, capsys):
    committed = write_jsonl(tmp_path / "committed.jsonl", page_rows())
    good = write_jsonl(tmp_path / "good.jsonl", page_rows())
    assert main(["report", good, "-o", str(tmp_path / "good.md"), "--check-against", committed]) == 0
    assert "protocol and parity match in all 4 cells" in capsys.readouterr().out
    bad = write_jsonl(tmp_path / "bad.jsonl", CHANGES["steps"][0])
    assert main(["report", bad, "-o", str(tmp_path / "bad.md"), "--check-against", committed]) == 1
    err = capsys.readouterr().err
    assert "differs from the committed page" in err and f"  - {CHANGES['steps'][1]}" in err.splitlines()
    assert (tmp_path / "bad.md").is_file()  # the run's page is written all the same


def test_a_row_that_predates_the_warm_up_length_warmed_up_a_pass_of_its_steps(tmp_path):
    """Committed rows without `warmup_pass_steps` ran warm-up passes of `steps`: a run that records it as 200 matches
    them; the control, 10, is named (a pass of `steps` reads so)."""
    committed = [{k: v for k, v in r.items() if k != "warmup_pass_steps"} for r in page_rows()]
    assert check(tmp_path, [{**r, "warmup_pass_steps": 200} for r in page_rows()], committed).problems == []
    short = [{**r, "warmup_pass_steps": 10 if i == 0 else 200} for i, r in enumerate(page_rows())]
    assert check(tmp_path, short, committed).problems == [
        "tiny-qwen2 poros: warmup_pass_steps 10 in this run, steps on the committed page"]
