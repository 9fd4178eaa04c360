"""A matrix that names a reference runs the reference's whole protocol (reports/reference/official.csv): steps,
passes, warm-up, settings, stacks, and each method on the attention path of the reference's note; `poros validate`
refuses one that does not, one line per field."""

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


DRIFTS = {  # one field of matrices/b300.yaml off the reference's protocol, and the line that names it
    "steps": ({"steps": 50}, "steps: its figures ran 200, this matrix 50"),
    "passes": ({"passes": 1}, "passes: its figures ran 3, this matrix 1"),
    "warmup_passes": ({"warmup_passes": 0}, "warmup_passes: its figures ran 1, this matrix 0"),
    "warmup_passes-2": ({"warmup_passes": 2}, "warmup_passes: its figures ran 1, this matrix 2"),
    "warmup_pass_steps": ({"warmup_pass_steps": 10}, "warmup_pass_steps: its figures ran 200, this matrix 10"),
    "seq_len": ({"seq_len": 1024}, "seq_len: its figures ran 512, this matrix 1024"),
    "batch_size": ({"batch_size": 2}, "batch_size: its figures ran 1, this matrix 2"),
    "grad_accum": ({"grad_accum": 4}, "grad_accum: its figures ran 1, this matrix 4"),
    "lora_rank": ({"lora_rank": 8}, "lora_rank: its figures ran 16, this matrix 8"),
    "lora_alpha": ({"lora_alpha": 16}, "lora_alpha: its figures ran 32, this matrix 16"),
    "block_size": ({"block_size": 8}, "block_size: its figures ran 4, this matrix 8"),
    "block_size-per-model": ({"model_overrides": {"qwen2.5-72b": {"block_size": 2}}},
                             "block_size: its figures ran 4, this matrix 4 and 2"),
    "block_size-per-plan": ({"plans": {"b2": {"block_size": 2}, "b4": {}}},
                            "block_size: its figures ran 4, this matrix 2 and 4"),
    "lora_rank-per-method": ({"method_settings": {"poros": {"attention": "math"}, "resident": {"lora_rank": 8}}},
                             "lora_rank: its figures ran 16, this matrix 16 and 8"),
    "seq_len-swept": ({"sweep": {"seq_len": [512, 2048]}}, "seq_len: its figures ran 512, this matrix 512 and 2048"),
    "stacks-current": ({"stacks": ["current"]}, "stacks: its figures ran torch 2.10.0+cu128 / transformers 5.5.0, "
                       "bitsandbytes 0.49.2 and torch 2.12.0+cu130 / transformers 5.10.1, bitsandbytes 0.49.2; this "
                       "matrix pins current (the installed stack)"),
    "stacks-build": ({"stacks": [{"name": "torch210", "torch": "2.10.0+cu126", "transformers": "5.5.0",
                                  "bitsandbytes": "0.49.2"},
                                 {"name": "torch212", "torch": "2.12.0+cu130", "transformers": "5.10.1",
                                  "bitsandbytes": "0.49.2"}]}, "this matrix pins torch 2.10.0+cu126 / transformers"),
    "stacks-bitsandbytes": ({"stacks": [{"name": "torch212", "torch": "2.12.0+cu130", "transformers": "5.10.1",
                                         "bitsandbytes": "0.50.2"}]},
                            "this matrix pins torch 2.12.0+cu130 / transformers 5.10.1, bitsandbytes 0.50.2"),
    "attention": ({"method_settings": None}, "its figures ran poros on math"),
}


@pytest.mark.parametrize("case", DRIFTS, ids=lambda c: f"field={c}")
def test_each_field_off_the_reference_protocol_is_one_problem(case):
    change, line = DRIFTS[case]
    data = {k: v for k, v in {**_data("b300"), **change}.items() if v is not None}
    if "seq_len" in change.get("sweep", {}):
        del data["seq_len"]
    (problem,) = reference_problems(parse_matrix(data, "b300.yaml"))
    assert problem.startswith("reference B300: ") and line in problem, problem


def test_the_faithful_matrices_differ_in_nothing():
    """Negative controls of the above: b300.yaml and a100.yaml as shipped (the A100 rows state no stack, so a100's
    `current` stack is not held to one), and a warm-up pass of the matrix's own length stated outright."""
    for name in ("b300", "a100"):
        assert reference_problems(load_matrix(name)) == [], name
    assert reference_problems(parse_matrix({**_data("b300"), "warmup_pass_steps": 200}, "b300.yaml")) == []


def test_a_field_the_reference_does_not_state_is_not_held(tmp_path):
    """A reference CSV that leaves steps empty and states another dataset: steps go unchecked, the dataset is named;
    rows that state two values of one field are named too."""
    text = OFFICIAL_REFERENCE_TEXT()
    header = text.splitlines()[1].split(",")
    col = {k: header.index(k) for k in ("steps", "dataset", "passes")}
    lines = text.splitlines()
    out = lines[:2]
    for i, line in enumerate(lines[2:]):
        cells = line.split(",")
        cells[col["steps"]] = ""
        cells[col["dataset"]] = "alpaca"
        cells[col["passes"]] = "3" if i else "5"
        out.append(",".join(cells))
    csv = tmp_path / "ref.csv"
    csv.write_text("\n".join(out) + "\n")
    m = parse_matrix({**_data("b300"), "steps": 50}, "b300.yaml")
    assert reference_problems(m, csv) == ["reference B300: passes: its rows state 5 and 3; give one",
                                          "reference B300: dataset: its figures ran alpaca, this matrix synthetic"]


def OFFICIAL_REFERENCE_TEXT() -> str:
    from poros.harness.report import OFFICIAL_REFERENCE

    return OFFICIAL_REFERENCE.read_text()


def test_validate_names_every_field_of_a_drifted_copy_one_line_each(tmp_path, capsys):
    """The b300 copy at 50 steps, 1 pass, no warm-up, seq 1024, rank 8 and block 8: six lines, one per field."""
    from poros.cli import main

    bad = tmp_path / "b300.yaml"
    bad.write_text(yaml.safe_dump({**_data("b300"), "steps": 50, "passes": 1, "warmup_passes": 0, "seq_len": 1024,
                                   "lora_rank": 8, "block_size": 8}))
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"FAIL {bad}:"
    assert [line.split(":")[1].strip() for line in out[1:]] == ["steps", "passes", "warmup_passes", "seq_len",
                                                                "lora_rank", "block_size"], out


def test_the_official_rows_state_the_documents_configuration():
    """Both tables share the document's Configuration table (tests/harness/test_matrices.py's OFFICIAL); the B300
    rows state bitsandbytes 0.49.2 beside their stacks, the A100 rows no stack at all."""
    from tests.harness.test_matrices import OFFICIAL

    ref = load_reference()
    for r in ref.to_dict("records"):
        assert {k: r[k] for k in OFFICIAL} == OFFICIAL, r["model"]
        assert (r["warmup_passes"], r["warmup_pass_steps"]) == (1, 200)
        assert (r["bitsandbytes"] == "0.49.2") is (r["hardware"] == "B300") is isinstance(r["stack"], str)
