"""Sweep rows: loading sweep files, and the fields tables and plots read from a row."""

from __future__ import annotations

import json

import pytest

from poros.errors import PorosError
from poros.harness.sweep_rows import field, gpu_label, is_timed, load_sweeps, plan_name, same_machine


def row(**kw) -> dict:
    base = {"model": "tiny-qwen3", "method": "poros", "s_per_step_median": 0.5,
            "provenance": {"host": "h", "time": "t", "gpus": [{"uuid": "GPU-0123abcd-ffff"}]}}
    return {**base, **kw}


def test_load_sweeps_keeps_order_and_skips_blank_lines(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(row(model="m1")) + "\n\n" + json.dumps(row(model="m2")) + "\n")
    b.write_text(json.dumps(row(model="m3")) + "\n")
    assert [r["model"] for r in load_sweeps([a, b])] == ["m1", "m2", "m3"]


def test_load_sweeps_names_the_bad_line(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(row()) + "\n{torn\n")
    with pytest.raises(PorosError, match=r"s\.jsonl:2: not valid JSON"):
        load_sweeps([p])
    with pytest.raises(PorosError, match="no such sweep file"):
        load_sweeps([tmp_path / "missing.jsonl"])
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PorosError, match="no sweep rows"):
        load_sweeps([tmp_path / "empty.jsonl"])


def test_fields_default_for_rows_that_predate_them():
    assert field(row(), "grad_accum") == 1 and field(row(), "world_size") == 1
    assert field(row(grad_accum=8), "grad_accum") == 8


def test_timed_rows_exclude_controls_and_failures():
    assert is_timed(row())
    assert not is_timed(row(method="resident (control)"))
    assert not is_timed(row(error="out of memory"))
    assert not is_timed(row(s_per_step_median=None))


def test_plan_name_spells_the_plan():
    assert plan_name(row(method="resident")) == "resident"
    assert plan_name(row()) == "poros, every layer streamed"
    assert plan_name(row(vram_budget=24e9, placement="spread", cuda_graphs=True)) == \
        "poros, budget 24 GB, spread, CUDA graphs"
    assert plan_name(row(vram_budget="auto", offload_inputs="True", overlap_backward=False,
                         accumulation="micro", keep_activations=True, kept_layers=20)) == \
        ("poros, budget auto, inputs in host memory, serial backward, micro-major accumulation, "
         "activations kept (20 layers)")


def test_gpu_label_and_same_machine():
    one = row()
    assert gpu_label(one) == "0123abcd"
    assert gpu_label(row(provenance={"host": "h"})) == "cpu"
    two = row(provenance={"host": "h", "gpus": [{"uuid": "GPU-x"}, {"uuid": "GPU-0123abcd-ffff"}]})
    assert same_machine(one, two)
    assert not same_machine(one, {**two, "provenance": {**two["provenance"], "host": "other"}})
    assert not same_machine(row(provenance={"host": "h", "gpus": [{"uuid": "GPU-y"}]}), two)
