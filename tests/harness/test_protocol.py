"""A matrix that names a reference runs each method on the attention path of the reference's note
(reports/reference/official.csv), and `poros validate` refuses one that does not, in one line."""

from __future__ import annotations

import pytest
import yaml

from poros.config import Attention, Method
from poros.harness.cells import gate_config, matrix_cells
from poros.harness.matrix import MATRICES, load_matrix, parse_matrix
from poros.harness.protocol import note_attention, reference_problems
from poros.harness.report import load_reference

P, R, RG, RGO, U = Method.POROS, Method.RESIDENT, Method.RESIDENT_GC, Method.RESIDENT_GC_OFFLOAD, Method.UNSLOTH


def test_notes_of_the_official_reference():
    assert set(load_reference()["attention_note"]) == {"poros math-only SDPA; baselines default flash",
                                                       "all methods default fast path"}
    assert note_attention("poros math-only SDPA; baselines default flash") == {
        P: Attention.MATH, R: Attention.FLASH, RG: Attention.FLASH, RGO: Attention.FLASH, U: Attention.FLASH}
    assert note_attention("all methods default fast path") == dict.fromkeys((P, R, RG, RGO, U), Attention.DEFAULT)


@pytest.mark.parametrize("note, why", [
    ("poros on a whim", "names no attention path"),
    ("everyone default flash", "neither"),
    ("poros math-only SDPA; all methods default flash", "twice"),
], ids=["path", "subject", "twice"])
def test_a_note_poros_cannot_read_is_refused(note, why):
    with pytest.raises(ValueError, match=why):
        note_attention(note)


@pytest.mark.parametrize("name", ["b300", "a100"], ids=lambda n: f"matrix={n}")
def test_reference_matrix_runs_the_reference_attention(name):
    m = load_matrix(name)
    assert m.reference in set(load_reference()["hardware"])
    assert reference_problems(m) == []


def test_b300_gate_runs_on_poros_path():
    m = load_matrix("b300")
    gates = [c for c in matrix_cells(m) if c.method is None]
    assert gates and {gate_config(m, c).attention for c in gates} == {Attention.MATH}


def _data(name: str) -> dict:
    return yaml.safe_load((MATRICES / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name, change, named", [
    ("b300", {"method_settings": None}, "poros on flash"),  # every method on the baselines' flash
    ("b300", {"attention": "default"}, "resident on default, unsloth on default"),
    ("a100", {"method_settings": {"resident": {"attention": "flash"}}}, "resident on flash"),
], ids=["b300-poros-on-flash", "b300-baselines-default", "a100-resident-flash"])
def test_matrix_off_the_reference_attention_is_one_problem(name, change, named):
    data = {k: v for k, v in {**_data(name), **change}.items() if v is not None}
    (problem,) = reference_problems(parse_matrix(data, f"{name}.yaml"))
    assert problem.startswith(f"reference {data['reference']}: its figures ran ") and f"this matrix runs {named}:" in problem


def test_matrix_without_reference_or_with_unknown_hardware():
    data = _data("b300")
    loose = {k: v for k, v in data.items() if k not in ("reference", "method_settings")}
    assert reference_problems(parse_matrix(loose)) == []  # no reference named: nothing to hold it to
    (problem,) = reference_problems(parse_matrix({**data, "reference": "H100"}))
    assert "no rows of hardware 'H100'" in problem and "B300" in problem


def test_validate_refuses_a_matrix_off_the_reference_in_one_line(tmp_path, capsys):
    from poros.cli import main

    bad = tmp_path / "b300.yaml"
    bad.write_text(yaml.safe_dump({k: v for k, v in _data("b300").items() if k != "method_settings"}))
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"FAIL {bad}:" and len(out) == 2 and "poros on flash" in out[1]
    assert main(["validate", str(MATRICES / "b300.yaml"), str(MATRICES / "a100.yaml")]) == 0  # the neighbours
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [
        f"ok   {MATRICES}/b300.yaml", f"ok   {MATRICES}/a100.yaml"]
