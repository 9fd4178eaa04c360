"""A page of rows on several stacks: each model's poros s/step on each stack against its first stack's (the
reference's "no PyTorch-version regression", measured), and the reference's own ratio beside it under a heading that
names its hardware. A page of one stack has no such section."""

from __future__ import annotations

from poros.harness.report import OFFICIAL_REFERENCE, load_reference, load_results, render_markdown
from tests.harness.test_report import B300_GPU, TORCH210, TORCH212, cpu_row, fixture_row, on_gpu, tables, write_jsonl

CI = "torch 2.13.0+cpu / transformers 5.24.0"


def stack_rows(stack: str, poros: float, make=cpu_row) -> list[dict]:
    return [make(model="tiny-qwen3", arch="qwen3", method="poros", stack=stack, s_per_step_median=poros,
                 per_pass_s=[4 * poros] * 3),
            make(model="tiny-qwen3", arch="qwen3", method="resident", stack=stack, per_pass_s=[1.4] * 3)]


def across(md: str) -> list[list[str]]:
    (table,) = [t for t in tables(md) if t[0][-1] == "vs first stack" and t[0][1] == "Stack"]
    return table[2:]


def test_each_stack_against_the_first(tmp_path):
    rows = stack_rows(TORCH210, 0.0500) + stack_rows(TORCH212, 0.0505) + stack_rows(CI, 0.0450)
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert "## Across stacks" in md and f"first stack ({TORCH210})" in md
    assert [(r[1], r[2], r[3], r[4]) for r in across(md)] == [
        (TORCH210, "PASS (0.00e+00)", "0.0500±0.0123", "—"),
        (TORCH212, "PASS (0.00e+00)", "0.0505±0.0123", "1.010×"),
        (CI, "PASS (0.00e+00)", "0.0450±0.0123", "0.900×")]


def test_a_page_of_one_stack_has_no_such_section(tmp_path):
    """The control: the same rows on one stack."""
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", stack_rows(TORCH210, 0.05))), load_reference())
    assert "Across stacks" not in md and "across its stacks" not in md


def test_the_reference_s_stacks_stand_beside_under_their_hardware(tmp_path):
    """On the CPU the reference's B300 ratios are other hardware's (1.0483 / 1.0585 = 0.990×); on a B300 they are this
    hardware's."""
    ref = load_reference(OFFICIAL_REFERENCE)
    cpu = render_markdown(load_results(write_jsonl(tmp_path / "c.jsonl", stack_rows(TORCH210, 0.05) +
                                                   stack_rows(TORCH212, 0.05))), ref)
    section = cpu.split("## The reference across its stacks, on other hardware (B300)", 1)[1]
    assert f"| Qwen3-32B | B300 | {TORCH212} | 1.0483±0.0096 | 0.990× |" in section
    assert "| Qwen2.5-72B | B300 | torch 2.12.0+cu130 / transformers 5.10.1 | 1.8635±0.0101 | 0.998× |" in section
    assert "A100" not in section  # its rows state no stack
    gpu = [r for s in (TORCH210, TORCH212) for r in on_gpu(stack_rows(s, 1.05, fixture_row), B300_GPU)]
    b300 = render_markdown(load_results(write_jsonl(tmp_path / "b.jsonl", gpu)), ref)
    assert "## The reference across its stacks, on this hardware (B300)" in b300
