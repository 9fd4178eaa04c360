"""`poros.harness.report` and `poros report`: tables rendered from fixture results rows (made-up numbers) and
from the official reference figures in reports/reference/."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from poros.cli import main
from poros.errors import PorosError
from poros.harness.report import OFFICIAL_REFERENCE, figure, load_reference, load_results, render_markdown, write_report

RESULTS_HEADER = (
    "| Model | Arch | Stack | Bitwise parity | poros s/step (median±std) | resident s/step (median±std) "
    "| unsloth s/step | Slowdown vs resident | vs unsloth | poros VRAM | resident VRAM | unsloth VRAM "
    "| VRAM cut vs resident | vs unsloth |"
)
CPU_HEADER = ("| Model | Arch | Stack | Bitwise parity | poros s/step (median±std) | resident s/step (median±std) "
              "| Slowdown vs resident |")
STACK = "torch 2.11.0+cu130 / transformers 5.17.0"
OTHER_STACK = "torch 2.10.0+cu128 / transformers 5.5.0"


def fixture_row(model="qwen2.5-32b", method="poros", stack=STACK, **kw) -> dict:
    """One fixture results row; every number is made up for the test."""
    row = {
        "matrix": "fixture", "model": model, "arch": "qwen2", "method": method, "stack": stack,
        "stack_name": "current", "steps": 200, "passes": 3, "warmup_passes": 1, "reduced": False,
        "s_per_step_median": {"poros": 1.2345, "resident": 0.3456, "unsloth": 0.4567}[method],
        "s_per_step_std": {"poros": 0.0123, "resident": 0.0012, "unsloth": 0.0021}[method],
        "per_pass_s": [1.0, 1.1, 1.2], "tokens_per_s": 414.7 if method == "poros" else 1481.5,
        "peak_vram_gb": {"poros": 12.34, "resident": 40.12, "unsloth": 21.98}[method], "peak_vram_nvml_gb": 13.0,
        "parity": "PASS" if method != "unsloth" else None,
        "parity_max_abs_diff": 0.0 if method != "unsloth" else None,
        "bytes_h2d_per_step": 39_500_000_000 if method == "poros" else None,
        "copy_gbps": 24.6 if method == "poros" else None, "copy_hidden_share": 0.875 if method == "poros" else None,
        "status": "ok", "error": None,
        "config": {"seq_len": 512, "batch_size": 1, "grad_accum": 1, "lora_rank": 16, "lora_alpha": 32,
                   "block_size": 4, "dataset": "synthetic", "precision": "nf4", "attention": "math",
                   "device": "cuda", "hardware": None},
        "provenance": {
            "python": "3.11.9", "platform": "Linux", "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91000,
            "versions": {"torch": "2.11.0+cu130", "transformers": "5.17.0", "peft": "0.18.0",
                         "bitsandbytes": "0.49.2", "accelerate": "1.10.0", "unsloth": None, "poros": "0.1.0"},
            "git": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True},
            "gpus": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-fixture-uuid", "driver": "580.1",
                      "memory_gb": 143.8}],
            "host": "fixture-host", "time": "2026-01-02T03:04:05+00:00", "argv": ["poros", "bench"],
        },
    }
    row.update(kw)
    return row


def cpu_row(**kw) -> dict:
    """A fixture row measured on the CPU: no GPU, no device memory."""
    row = fixture_row(**kw)
    row["config"] = {**row["config"], "device": "cpu", "hardware": "CPU"}
    row["provenance"] = {**row["provenance"], "gpus": [], "cuda": None}
    return {**row, "peak_vram_gb": None, "peak_vram_nvml_gb": None}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cells(line: str) -> list[str]:
    """The cells of one Markdown table line, split on unescaped pipes only ("max \\|diff\\|" is one cell)."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])]


def tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table in `md` as its lines' cells (header first, then the `---` line, then rows)."""
    out, current = [], None
    for line in md.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                out.append(current)
            current.append(cells(line))
        else:
            current = None
    return out


def assert_tables_well_formed(md: str) -> None:
    """Every table has a header, a `---` line of as many columns, and rows of exactly as many cells."""
    found = tables(md)
    assert found, "no table rendered"
    for table in found:
        header, rule, *rows = table
        assert rule == ["---"] * len(header), f"table {header}: separator {rule}"
        for row in rows:
            assert len(row) == len(header), f"table {header}: row of {len(row)} cells for {len(header)} columns: {row}"


MEMORY_SECTION = "Tokens/s and the process's memory"


def table_rows(md: str, first_cell: str, ncols: int = 14, section: str | None = None) -> list[list[str]]:
    """Cells of the rows starting with `first_cell` in tables of `ncols` columns (14: the results table): in the page's
    section titled `section`, or where None in any section but the memory table's (MEMORY_SECTION, whose rows start
    with the results table's model names)."""
    rows, title = [], ""
    for line in md.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith(f"| {first_cell} |") and (title == section if section else title != MEMORY_SECTION):
            rows.append(cells(line))
    return [r for r in rows if len(r) == ncols]


def three_methods(**kw) -> list[dict]:
    return [fixture_row(method=m, **kw) for m in ("poros", "resident", "unsloth")]


def test_header_matches_official_table(tmp_path):
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", three_methods())))
    assert RESULTS_HEADER in md.splitlines()
    assert "# Poros — Validation Results (NVIDIA H200)" in md


def test_pass_row_formats_like_official_table(tmp_path):
    rows = three_methods()
    p, r, u = rows
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen2.5-32b")
    assert cells == [
        "qwen2.5-32b", "qwen2", STACK, "PASS (0.00e+00)",
        f"{p['s_per_step_median']:.4f}±{p['s_per_step_std']:.4f}",
        f"{r['s_per_step_median']:.4f}±{r['s_per_step_std']:.4f}", f"{u['s_per_step_median']:.4f}",
        f"{p['s_per_step_median'] / r['s_per_step_median']:.2f}×",
        f"{p['s_per_step_median'] / u['s_per_step_median']:.2f}×",
        f"{p['peak_vram_gb']:.2f} GB", f"{r['peak_vram_gb']:.2f} GB", f"{u['peak_vram_gb']:.2f} GB",
        f"{(1 - p['peak_vram_gb'] / r['peak_vram_gb']) * 100:.1f}%",
        f"{(1 - p['peak_vram_gb'] / u['peak_vram_gb']) * 100:.1f}%",
    ]
    assert cells[7] == "3.57×" and cells[12] == "69.2%"  # hand-computed: 1.2345/0.3456, 1-12.34/40.12


def test_a_method_without_cells_gets_no_columns(tmp_path):
    """No unsloth cell: no unsloth columns of dashes (they were there before)."""
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", three_methods()[:2])))
    (cells,) = table_rows(md, "qwen2.5-32b", 10)
    assert "unsloth" not in md.split("## Results")[1].split("\n\n")[1]
    assert cells[5] != "—" and cells[6] == "3.57×" and cells[9] == "69.2%"


def test_a_missing_cell_of_a_present_method_renders_dash(tmp_path):
    rows = three_methods() + [fixture_row(model="qwen3-32b", method=m) for m in ("poros", "resident")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen3-32b")
    assert cells[6] == cells[8] == cells[11] == cells[13] == "—"
    assert cells[5] != "—" and cells[7] != "—"


def test_resident_gc_gets_the_timing_column_where_resident_is_absent(tmp_path):
    rows = [fixture_row(method="poros"), {**fixture_row(method="resident"), "method": "resident_gc"}]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert "| resident_gc s/step (median±std) | Slowdown vs resident_gc |" in md
    (cells,) = table_rows(md, "qwen2.5-32b", 10)
    assert cells[5] == "0.3456±0.0012" and cells[6] == "3.57×"


def test_plans_and_sweep_points_are_rows_of_their_own(tmp_path):
    rows = [{**fixture_row(method=m), "plan_name": plan, "sweep": {"seq_len": seq}}
            for seq in (512, 1024) for m, plan in (("poros", "streamed"), ("poros", "24GB"), ("resident", None))]
    rows[1]["s_per_step_median"] = 0.5
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    got = table_rows(md, "qwen2.5-32b", 12)
    assert [(c[3], c[4]) for c in got] == [("seq_len 512", "streamed"), ("seq_len 512", "24GB"),
                                           ("seq_len 1024", "streamed"), ("seq_len 1024", "24GB")]
    assert got[1][6] == "0.5000±0.0123" and got[1][8] == f"{0.5 / 0.3456:.2f}×"


def _at(seq: int, matrix: str, **kw) -> list[dict]:
    rows = [fixture_row(method=m, matrix=matrix, **kw) for m in ("poros", "unsloth")]
    for r in rows:
        r["config"] = {**r["config"], "seq_len": seq}
    return rows


def test_rows_of_two_lengths_pair_with_their_own_length(tmp_path):
    """A page of two matrices, each at its own sequence length: each poros row stands beside the Unsloth row of its
    length (rows keyed by model and stack alone paired the first length's poros with the last length's Unsloth)."""
    short, long = _at(32768, "short"), _at(65536, "long")
    short[1]["s_per_step_median"], short[1]["tokens_per_s"] = 1.0, 100.0
    long[0]["s_per_step_median"], long[0]["tokens_per_s"] = 3.0, 60.0
    long[1]["s_per_step_median"], long[1]["tokens_per_s"] = 2.0, 80.0
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", short + long)))
    got = table_rows(md, "qwen2.5-32b", 15)
    assert [(c[3], c[7], c[9]) for c in got] == [("seq_len 32768", "1.0000", "1.23×"),  # 1.2345 / 1.0
                                                 ("seq_len 65536", "2.0000", "1.50×")]  # 3.0 / 2.0
    memory = {c[0]: c[3] for c in table_rows(md, "qwen2.5-32b (seq_len 65536)", 10, MEMORY_SECTION) if c[1] == "poros"}
    assert memory == {"qwen2.5-32b (seq_len 65536)": "0.750×"}  # 60 / 80 tokens/s
    one_length = render_markdown(load_results(write_jsonl(tmp_path / "one.jsonl", _at(512, "short"))))
    assert "seq_len" not in one_length.split("## Results")[1]  # a page of one length names none


def test_the_protocol_line_pairs_each_protocol_with_its_warm_up(tmp_path):
    """Rows of two protocols: each count beside its own warm-up, one step and one pass in the singular."""
    rows = ([fixture_row(method=m, steps=1, passes=1, warmup_pass_steps=1) for m in ("poros", "resident")]
            + [fixture_row(method=m, matrix="other", steps=2, passes=3, warmup_pass_steps=2,
                           sweep={"seq_len": 1024}) for m in ("poros", "resident")])
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert ("each cell 1 step × 1 pass after a discarded 1-step warm-up; 2 steps × 3 passes after a discarded "
            "2-step warm-up in its process") in md
    assert "| Steps × passes | 1 step × 1 pass, 2 steps × 3 passes (" in md


def test_a_cpu_cell_whose_passes_spread_is_flagged(tmp_path):
    rows = [{**r, "config": {**r["config"], "device": "cpu"}, "provenance": {**r["provenance"], "gpus": []}}
            for r in three_methods()[:2]]
    rows[0]["per_pass_s"] = [1.0, 1.5, 1.1]  # 50% of the median 1.1
    rows[1]["per_pass_s"] = [1.0, 1.02, 1.01]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen2.5-32b", 7)
    assert cells[4].endswith("†") and not cells[5].endswith("†")
    results = md.split("## Results")[1]
    warning = results.index("> **These timings cannot be trusted:** the CPU was shared or busy while 1 of the cells "
                            "below ran — qwen2.5-32b poros (its passes spread 45% of their median).")
    assert warning < results.index("| Model |"), "above the table, not under it"


def _cpu_rows(load, cores=2, spread=(1.0, 1.01, 1.02)):
    rows = [{**r, "config": {**r["config"], "device": "cpu"}, "provenance": {**r["provenance"], "gpus": []},
             "per_pass_s": list(spread), "load_avg_max": load, "cores": cores} for r in three_methods()[:2]]
    return rows


@pytest.mark.parametrize("load, cores, fires", [(5.3, 2, True), (1.9, 2, False), (5.3, 8, False), (None, 2, False)],
                         ids=["load-5.3-on-2", "load-1.9-on-2", "load-5.3-on-8", "load-unknown"])
def test_a_load_above_the_cpus_during_the_passes_is_said_above_the_table(tmp_path, load, cores, fires, capsys):
    """The check fires where the load average as the passes ended exceeded the CPUs the process could use, and stays
    silent where it did not, where the machine has CPUs to spare, and where the rows do not say (older rows)."""
    path = write_jsonl(tmp_path / "r.jsonl", _cpu_rows(load, cores))
    md = render_markdown(load_results(path))
    assert ("These timings cannot be trusted" in md) is fires
    if fires:
        assert ("qwen2.5-32b poros (the load average reached 5.3 on 2 CPUs); qwen2.5-32b resident (the load average "
                "reached 5.3 on 2 CPUs)") in md
    assert main(["report", str(path), "-o", str(tmp_path / "r.md")]) == 0  # the table `poros report` prints too
    printed = capsys.readouterr().out
    assert ("These timings cannot be trusted" in printed.split("Results — CPU")[1]) is fires
    gpu = [{**r, "load_avg_max": 9.0, "cores": 2} for r in three_methods()[:2]]  # a GPU's timing: not the CPU's
    assert "cannot be trusted" not in render_markdown(load_results(write_jsonl(tmp_path / "g.jsonl", gpu)))


@pytest.mark.parametrize("change, named", [
    ({"s_per_step_median": "1.2"}, "field s_per_step_median: expected a number or null, got '1.2'"),
    ({"config": None}, "field config: expected a mapping, got None"),
    ({"provenance": "x"}, "field provenance: expected a mapping"),
])
def test_a_row_with_an_odd_field_is_one_line_naming_file_line_and_field(tmp_path, capsys, change, named):
    rows = three_methods()
    rows[1] = {**rows[1], **change}
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    assert main(["report", str(path), "-o", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2: {named}" in err, err


def test_report_exits_non_zero_when_a_cell_fails(tmp_path, capsys):
    rows = three_methods()
    rows[0] = {**rows[0], "parity": "FAIL"}
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    assert main(["report", str(path), "-o", str(tmp_path / "r.md")]) == 1
    assert "1 cell(s) FAIL: qwen2.5-32b poros: parity FAIL" in capsys.readouterr().err
    assert (tmp_path / "r.md").is_file()  # the report is still written
    assert main(["report", str(write_jsonl(tmp_path / "ok.jsonl", three_methods())), "-o", str(tmp_path / "o.md")]) == 0


def test_parity_fail_and_failed_status(tmp_path):
    rows = [fixture_row(parity="FAIL", parity_max_abs_diff=1.2e-3),
            fixture_row(method="resident", status="failed", s_per_step_median=None, error="CUDA OOM")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen2.5-32b", 10)
    assert cells[3] == "FAIL (max |diff| 1.20e-03)"
    assert cells[5] == "FAIL" and cells[6] == "—"


def test_last_row_wins(tmp_path):
    rows = three_methods() + [fixture_row(s_per_step_median=2.5, s_per_step_std=0.5)]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen2.5-32b")
    assert cells[4] == "2.5000±0.5000"


def test_stacks_are_separate_rows(tmp_path):
    rows = three_methods() + [fixture_row(stack=OTHER_STACK, s_per_step_median=1.1)]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert [c[2] for c in table_rows(md, "qwen2.5-32b")] == [STACK, OTHER_STACK]


@pytest.mark.parametrize("reduced", [True, False], ids=lambda r: f"reduced={r}")
def test_reduced_note_iff_reduced(tmp_path, reduced):
    rows = [fixture_row(steps=5, passes=2, reduced=reduced)] + three_methods()[1:]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    note = "Reduced run: 5 steps × 2 passes (the matrix file asks for more) — not comparable to full runs."
    assert (note in md) is reduced
    assert ("Reduced run" in md) is reduced


def test_time_table_and_provenance(tmp_path):
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", three_methods())))
    assert "| qwen2.5-32b | " + STACK + " | 39.50 GB | 24.6 GB/s | 87.5% | 414.7 |" in md
    assert "0123456789abcdef0123456789abcdef01234567 (dirty)" in md
    assert "GPU-fixture-uuid" in md and "NVIDIA H200 (143.8 GB VRAM)" in md


def test_reference_matches_case_insensitively(tmp_path):
    ref_csv = tmp_path / "ref.csv"
    ref_csv.write_text(
        "hardware,model,arch,stack,parity,poros_s_step_median,poros_s_step_std,resident_s_step,unsloth_s_step,"
        "poros_vram_gb,resident_vram_gb,unsloth_vram_gb,attention_note\n"
        f"H200,Qwen2.5-32B,qwen2,{STACK},PASS,1.0012,0.0082,0.2755,0.4051,11.04,36.53,20.54,note\n"
        "H200,Qwen2.5-32B,qwen2,,,2.0489,0.0091,0.7662,0.9086,10.95,,20.82,note\n"
        "H200,Qwen2.5-72B,qwen2,,,1.8680,0.0087,0.4489,0.5917,18.16,67.63,42.46,note\n"
        f"B300,Qwen2.5-32B,qwen2,{STACK},PASS,0.9900,0.0049,0.2731,,11.04,36.54,,note\n"
    )
    df = load_results(write_jsonl(tmp_path / "r.jsonl", three_methods()))
    assert "Reference vs measured" not in render_markdown(df)
    md = render_markdown(df, load_reference(ref_csv))
    rows = table_rows(md, "Qwen2.5-32B", ncols=11)
    assert [r[1] for r in rows] == ["H200", "H200"]  # 72B was not measured: no row; the B300 row is not this hardware
    assert rows[0][3:] == ["1.0012±0.0082", "1.2345±0.0123", "0.2755", "0.3456±0.0012",
                           "11.04 GB", "12.34 GB", "36.53 GB", "40.12 GB"]
    # the second row states no stack: no measurement is known to be of its stack
    assert rows[1][2] == "—" and rows[1][4] == rows[1][6] == rows[1][8] == rows[1][10] == "—"
    # the results table names the model as the reference does
    assert table_rows(md, "Qwen2.5-32B") and not table_rows(md, "qwen2.5-32b")
    assert "## Reference vs measured, same hardware and stack" in md
    other = md.split("## The reference on other hardware (B300)", 1)[1]
    assert f"| Qwen2.5-32B | B300 | {STACK} |" in other  # same stack, other hardware: beside, never paired


def _reference_rows(md: str) -> dict:
    """{(model, reference stack): (ref poros, measured poros, ref resident, measured resident)} of a page."""
    return {(r[0], r[2]): (r[3], r[4], r[5], r[6]) for r in tables_with(md, "Reference stack")}


def tables_with(md: str, column: str) -> list[list[str]]:
    """The rows of the tables of `md` whose header has `column`."""
    return [row for t in tables(md) if column in t[0] for row in t[2:]]


TORCH210, TORCH212 = "torch 2.10.0+cu128 / transformers 5.5.0", "torch 2.12.0+cu130 / transformers 5.10.1"
B300_GPU = "NVIDIA B300 SXM6 AC"  # the name NVML and torch.cuda.get_device_name give a B300


def on_gpu(rows: list[dict], gpu: str, hardware: str | None = None) -> list[dict]:
    """`rows` run on a GPU named `gpu`, their matrix declaring `hardware`."""
    out = []
    for r in rows:
        gpus = [{**g, "name": gpu} for g in r["provenance"]["gpus"]]
        out.append({**r, "config": {**r["config"], "hardware": hardware}, "provenance": {**r["provenance"], "gpus": gpus}})
    return out


def _official_as_measured(stack: str, gpu: str = B300_GPU) -> list[dict]:
    """Rows of qwen3-32b on `stack` and a GPU named `gpu` carrying the reference's own poros and resident figures of
    that stack."""
    ref = load_reference(OFFICIAL_REFERENCE)
    (r,) = [r for r in ref.to_dict("records") if r["model"] == "Qwen3-32B" and r["stack"] == stack]
    return on_gpu([fixture_row(model="qwen3-32b", arch="qwen3", method=m, stack=stack, s_per_step_median=r[
        f"{m}_s_step" if m == "resident" else "poros_s_step_median"], s_per_step_std=0.0)
        for m in ("poros", "resident")], gpu)


def test_reference_row_stands_beside_its_own_stack_only(tmp_path):
    """The reference's figures fed back as measurements of each stack on a B300: each reference row meets its own."""
    ref = load_reference(OFFICIAL_REFERENCE)
    both = load_results(write_jsonl(tmp_path / "both.jsonl", _official_as_measured(TORCH210) +
                                    _official_as_measured(TORCH212)))
    page = render_markdown(both, ref)
    got = _reference_rows(page)
    assert got[("Qwen3-32B", TORCH210)] == ("1.0585±0.0044", "1.0585±0.0000", "0.2945", "0.2945±0.0000")
    assert got[("Qwen3-32B", TORCH212)] == ("1.0483±0.0096", "1.0483±0.0000", "0.2960", "0.2960±0.0000")
    assert ("Qwen3-32B", "—") not in got  # the A100 row is of other hardware
    assert "## Reference vs measured, same hardware and stack" in page
    assert "| Qwen3-32B | A100-80GB-PCIe |" in page.split("## The reference on other hardware (A100-80GB-PCIe)")[1]


def test_reference_row_of_another_stack_shows_no_measurement(tmp_path):
    """Only torch 2.10 measured on a B300: the torch 2.12 reference row stands beside nothing (not the 2.10
    figures), and a stack that differs only in its CUDA build, or does not state it, meets no reference row."""
    ref = load_reference(OFFICIAL_REFERENCE)
    only_210 = load_results(write_jsonl(tmp_path / "210.jsonl", _official_as_measured(TORCH210)))
    got = _reference_rows(render_markdown(only_210, ref))
    assert got[("Qwen3-32B", TORCH210)][1] == "1.0585±0.0000"  # the accepted neighbour
    assert got[("Qwen3-32B", TORCH212)][1:4:2] == ("—", "—")
    for other in ("torch 2.10.0+cu126 / transformers 5.5.0", "torch 2.10.0 / transformers 5.5.0"):
        rows = [{**r, "stack": other} for r in _official_as_measured(TORCH210)]
        page = render_markdown(load_results(write_jsonl(tmp_path / "o.jsonl", rows)), ref)
        # nothing pairs: no same-cell table, only the rows beside the reference, each naming its own stack
        assert "## Reference vs measured" not in page and _reference_rows(page) == {}, other
        assert f"| Qwen3-32B | {B300_GPU} (this page) | {other} |" in page


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA GB300"], ids=lambda g: f"gpu={g}")
def test_rows_of_other_hardware_never_pair_with_the_reference(tmp_path, gpu):
    """An H200 row labelled with the reference's torch 2.10 stack is not the B300's cell: no same-cell table, and
    the B300 and A100 rows stand under a heading that names them other hardware (a GB300 is not a B300 either)."""
    ref = load_reference(OFFICIAL_REFERENCE)
    page = render_markdown(load_results(write_jsonl(tmp_path / "h.jsonl", _official_as_measured(TORCH210, gpu))), ref)
    assert "## Reference vs measured" not in page and _reference_rows(page) == {}
    assert "same stack" not in page and "## The reference on this hardware" not in page
    other = page.split("## The reference on other hardware (B300, A100-80GB-PCIe)", 1)[1]
    assert f"| Qwen3-32B | B300 | {TORCH210} |" in other and "| Qwen3-32B | A100-80GB-PCIe |" in other


def test_the_a100_rows_are_this_hardware_on_an_a100(tmp_path):
    """On a GPU NVML names `NVIDIA A100 80GB PCIe` the reference's `A100-80GB-PCIe` rows are this hardware's; they
    name no stack, so none is paired. The control: an A100 SXM4 is other hardware."""
    ref = load_reference(OFFICIAL_REFERENCE)
    rows = [fixture_row(model="qwen3-32b", arch="qwen3", method=m) for m in ("poros", "resident")]
    pcie = render_markdown(load_results(write_jsonl(tmp_path / "a.jsonl", on_gpu(rows, "NVIDIA A100 80GB PCIe"))), ref)
    this = pcie.split("## The reference on this hardware (A100-80GB-PCIe)", 1)[1].split("## The reference on other")[0]
    assert "| Qwen3-32B | A100-80GB-PCIe |" in this and "## Reference vs measured" not in pcie
    assert "| Qwen3-32B | B300 |" in pcie.split("## The reference on other hardware (B300)", 1)[1]
    sxm = render_markdown(load_results(write_jsonl(tmp_path / "s.jsonl", on_gpu(rows, "NVIDIA A100-SXM4-80GB"))), ref)
    assert "## The reference on this hardware" not in sxm
    assert "| Qwen3-32B | A100-80GB-PCIe |" in sxm.split("## The reference on other hardware (B300, A100-80GB-PCIe)")[1]


def test_the_rows_beside_the_reference_name_their_hardware_stack_and_attention(tmp_path):
    ref = load_reference(OFFICIAL_REFERENCE)
    page = render_markdown(load_results(write_jsonl(tmp_path / "m.jsonl", _official_as_measured(TORCH210, "NVIDIA H200"))),
                           ref)
    section = page.split("## The reference on other hardware", 1)[1].split("\n\n")[1].splitlines()
    b300 = next(line for line in section if line.startswith("| Qwen3-32B | B300 | torch 2.10.0+cu128"))
    cells = [c.strip() for c in b300.strip("|").split("|")]
    assert cells[3] == "poros math-only SDPA; baselines default flash"
    assert cells[7:9] == ["3.59×", "2.61×"]  # the reference's own ratios, computed from its figures
    assert cells[12:14] == ["70.7%", "45.7%"]  # its table says 45.8%: computed from the rounded figures
    assert any(line.startswith("| Qwen3-32B | NVIDIA H200 (this page) |") for line in section)
    assert not any(line.startswith("| Qwen2.5-72B |") for line in section), "a model not measured has no rows"


def test_write_report_writes_markdown_and_png(tmp_path):
    out = write_report([write_jsonl(tmp_path / "r.jsonl", three_methods())], tmp_path / "reports" / "h200.md")
    png = tmp_path / "reports" / "h200.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![s/step vs peak VRAM](h200.png)" in out.read_text()


@pytest.mark.parametrize("line, why", [('{"matrix": "x",', "not valid JSON"), ('{"matrix": "x"}', "missing key(s)")],
                         ids=["malformed", "missing-keys"])
def test_bad_jsonl_names_file_and_line(tmp_path, line, why):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(fixture_row()) + "\n" + line + "\n")
    with pytest.raises(PorosError, match=r"r\.jsonl:2: " + re.escape(why)) as e:
        load_results([path])
    assert "\n" not in str(e.value)


def test_cli_writes_report(tmp_path, capsys):
    results = write_jsonl(tmp_path / "r.jsonl", three_methods())
    out = tmp_path / "h200.md"
    assert main(["report", results, "-o", str(out), "--title", "Fixture report"]) == 0
    assert out.read_text().startswith("# Fixture report (NVIDIA H200)")
    assert (tmp_path / "h200.png").is_file()
    stdout = capsys.readouterr().out
    assert str(out) in stdout and RESULTS_HEADER in stdout


def test_cli_missing_file_is_one_line_error(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert main(["report", str(missing), "-o", str(tmp_path / "x.md")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "nope.jsonl: no such results file" in err
    assert not (tmp_path / "x.md").exists()


def _schedule(model="qwen2.5-32b", **settings) -> dict:
    """A poros row of `model` run with the given schedule settings."""
    return fixture_row(model=model, config={**fixture_row()["config"], **settings})


TABLE_CASES = {
    "gpu": lambda: three_methods(),
    "cpu": lambda: [cpu_row(method=m) for m in ("poros", "resident")],
    "two-stacks": lambda: three_methods() + [fixture_row(stack=OTHER_STACK)],
    "two-schedules": lambda: [_schedule(cuda_graphs=True), _schedule(overlap_backward=True, model="qwen3-32b"),
                              fixture_row(method="resident")],
    "budget": lambda: [fixture_row(config={**fixture_row()["config"], "vram_budget": 24 * 10**9}),
                       fixture_row(method="resident")],
    "parity-fail": lambda: [fixture_row(parity="FAIL", parity_max_abs_diff=1.2e-3), fixture_row(method="resident")],
}


@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: f"rows={c}")
def test_every_table_row_has_the_header_column_count(tmp_path, case):
    df = load_results(write_jsonl(tmp_path / "r.jsonl", TABLE_CASES[case]()))
    assert_tables_well_formed(render_markdown(df, load_reference()))


def test_table_check_catches_a_stray_cell():
    """Negative control: a configuration row with a third cell (as "| x | y | ;  |") is refused."""
    md = "| Field | Value |\n|---|---|\n| Block size (poros) | 4, layers replayed from CUDA graphs | ;  |\n"
    with pytest.raises(AssertionError, match="row of 3 cells for 2 columns"):
        assert_tables_well_formed(md)
    assert_tables_well_formed(md.replace(" ;  |", ""))


def test_distinct_schedules_share_one_configuration_cell(tmp_path):
    rows = [_schedule(cuda_graphs=True), _schedule(overlap_backward=True, model="qwen3-32b")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cell,) = [r[1] for r in table_rows(md, "CUDA-graph layers (poros)", ncols=2)]
    assert cell == "on; off"
    (cell,) = [r[1] for r in table_rows(md, "Block size (poros)", ncols=2)]
    assert cell == "4"


def test_the_mlp_chunk_row_shows_where_a_run_chunked(tmp_path):
    """`mlp_chunk` labels its configuration row only where a run set it (pages of earlier rows stay as they are)."""
    plain = [fixture_row(method=m) for m in ("poros", "resident")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "plain.jsonl", plain)))
    assert not table_rows(md, "MLP chunk (tokens)", ncols=2)
    config = {**fixture_row()["config"], "mlp_chunk": 4096}
    chunked = [fixture_row(method=m, config=config) for m in ("poros", "resident")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "chunked.jsonl", chunked)))
    assert [r[1] for r in table_rows(md, "MLP chunk (tokens)", ncols=2)] == ["4096"]


def test_cpu_report_leaves_out_device_memory_and_copies(tmp_path):
    rows = [{**cpu_row(method=m), "per_pass_s": [1.0, 1.0]} for m in ("poros", "resident")]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert CPU_HEADER in md.splitlines()
    for absent in ("VRAM", "Where the time goes", "Host→device", "Copy GB/s", "hidden behind compute", "CUDA",
                   "GPU"):
        assert absent not in md, f"{absent!r} in a CPU report"
    (cells_,) = table_rows(md, "qwen2.5-32b", ncols=7)
    assert cells_[4:6] == ["1.2345±0.0123", "0.3456±0.0012"] and cells_[6] == "3.57×"
    # The same rows on a GPU keep all of it.
    gpu = render_markdown(load_results(write_jsonl(tmp_path / "g.jsonl", three_methods())))
    assert "Where the time goes" in gpu and "CUDA 13.0" in gpu and RESULTS_HEADER in gpu.splitlines()


def test_cpu_plot_shows_s_per_step_per_model_and_method(tmp_path):
    rows = [cpu_row(model=m, method=x) for m in ("tiny-qwen2", "tiny-qwen3") for x in ("poros", "resident")]
    df = load_results(write_jsonl(tmp_path / "r.jsonl", rows))
    (ax,) = figure(df).axes
    assert ax.get_title() == "s/step per model and method"
    heights = sorted(round(b.get_height(), 4) for b in ax.patches)
    assert heights == [0.3456, 0.3456, 1.2345, 1.2345]  # one bar per measured cell, at its median
    assert [t.get_text() for t in ax.get_xticklabels()] == ["tiny-qwen2", "tiny-qwen3"]
    assert not [t for t in ax.texts if t.get_text() == "no measured cells"]
    out = write_report([write_jsonl(tmp_path / "r.jsonl", rows)], tmp_path / "cpu.md")
    assert out.read_text().endswith("## s/step per model and method\n\n![s/step per model and method](cpu.png)\n")


def test_gpu_plot_is_s_per_step_against_vram(tmp_path):
    (ax,) = figure(load_results(write_jsonl(tmp_path / "r.jsonl", three_methods()))).axes
    assert ax.get_title() == "s/step vs peak VRAM" and not ax.patches
    (points,) = [c for c in ax.collections if len(c.get_offsets()) and c.get_label() == "poros"]
    assert points.get_offsets().tolist() == [[12.34, 1.2345]]


def test_gpu_plot_names_each_points_plan_and_length(tmp_path):
    """Points of one model differ by plan and length on a page of several: each label says which (they were all
    the model's name alone)."""
    rows = [{**r, "plan_name": "24GB"} if r["method"] == "poros" else r for r in _at(32768, "short")] + _at(65536, "long")
    (ax,) = figure(load_results(write_jsonl(tmp_path / "r.jsonl", rows))).axes
    assert sorted(t.get_text() for t in ax.texts) == ["qwen2.5-32b (seq_len 32768)", "qwen2.5-32b (seq_len 32768, plan 24GB)",
                                                      "qwen2.5-32b (seq_len 65536)", "qwen2.5-32b (seq_len 65536)"]


def test_official_reference_ships_with_its_source():
    ref = load_reference()
    assert OFFICIAL_REFERENCE.name == "official.csv" and OFFICIAL_REFERENCE.is_file()
    assert ref.attrs["source"].startswith('"Poros — Official Validation Results (NVIDIA B300 SXM6)"')
    assert set(ref["hardware"]) == {"B300", "A100-80GB-PCIe"} and len(ref) == 10
    b300_72b = ref[(ref["hardware"] == "B300") & (ref["model"] == "Qwen2.5-72B")]
    assert b300_72b["poros_s_step_median"].tolist() == [1.8680, 1.8635]  # the document's Results — B300 table


def test_report_with_the_official_reference(tmp_path, capsys):
    results = write_jsonl(tmp_path / "r.jsonl", on_gpu(three_methods(stack=TORCH210), B300_GPU, "NVIDIA B300 SXM6"))
    out = tmp_path / "b300.md"
    assert main(["report", results, "-o", str(out), "--reference"]) == 0
    md = out.read_text()
    assert_tables_well_formed(md)
    rows = table_rows(md, "Qwen2.5-32B", ncols=11)
    assert [(r[1], r[3]) for r in rows] == [("B300", "1.0012±0.0082"), ("B300", "0.9900±0.0049")]
    assert [(r[4], r[6]) for r in rows] == [("1.2345±0.0123", "0.3456±0.0012"), ("—", "—")]
    assert "## The reference on other hardware (A100-80GB-PCIe)" in md
    assert 'Reference figures: "Poros — Official Validation Results (NVIDIA B300 SXM6)"' in md
    assert str(tmp_path) not in md  # nothing machine-specific: reports re-render identically anywhere


def test_reference_comment_lines_are_not_rows(tmp_path):
    ref_csv = tmp_path / "ref.csv"
    ref_csv.write_text(OFFICIAL_REFERENCE.read_text().replace("# Source:", "# a note\n# Source:", 1))
    ref = load_reference(ref_csv)
    assert len(ref) == 10 and ref.attrs["source"] == load_reference().attrs["source"]
    ref_csv.write_text("\n".join(OFFICIAL_REFERENCE.read_text().splitlines()[1:]))  # no comment: no source
    assert "source" not in load_reference(ref_csv).attrs


def test_missing_reference_is_one_line_error(tmp_path, capsys):
    results = write_jsonl(tmp_path / "r.jsonl", three_methods())
    assert main(["report", results, "-o", str(tmp_path / "x.md"), "--reference", str(tmp_path / "nope.csv")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "nope.csv: no such reference file" in err


def test_resident_gc_rows_are_labelled_and_name_their_gate(tmp_path):
    """A long-context matrix: poros gated against resident_gc; the parity cell names that reference."""
    rows = [fixture_row(gate="resident_gc"), {**fixture_row(method="resident", gate="resident_gc"),
                                              "method": "resident_gc"}, fixture_row(method="unsloth", gate=None)]
    md = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    (cells,) = table_rows(md, "qwen2.5-32b")
    assert cells[3] == "PASS vs resident_gc (0.00e+00)"
    assert cells[5] == "0.3456±0.0012"  # no plain resident: resident_gc has the reference's timing column
    assert "| Methods | poros (blockwise residency), resident + gradient checkpointing, unsloth |" in md
    (ax,) = figure(load_results(write_jsonl(tmp_path / "r.jsonl", rows))).axes
    assert {c.get_label() for c in ax.collections if len(c.get_offsets())} == {"poros", "resident_gc", "unsloth"}
    plain = render_markdown(load_results(write_jsonl(tmp_path / "p.jsonl", [fixture_row(gate="resident")])))
    assert table_rows(plain, "qwen2.5-32b", 10)[0][3] == "PASS (0.00e+00)"  # the usual reference goes unnamed


def _on(gpu: str, hardware: str | None, **kw) -> list[dict]:
    rows = three_methods(**kw)
    for r in rows:
        r["config"] = {**r["config"], "hardware": hardware}
        r["provenance"] = {**r["provenance"], "gpus": [{**r["provenance"]["gpus"][0], "name": gpu, "memory_gb": 85.0}]}
    return rows


def test_rows_of_a_matrix_run_on_another_gpu_name_the_gpu_they_ran_on(tmp_path):
    """A matrix declaring an H200 run on an H100: the page's headings and hardware row name the H100; the control,
    the same rows on an H200, keeps the declared name (and a declared short name, B300, matches the GPU's long one)."""
    md = render_markdown(load_results(write_jsonl(tmp_path / "a.jsonl", _on("NVIDIA H100 80GB HBM3", "NVIDIA H200"))))
    assert "## Results — NVIDIA H100 80GB HBM3" in md and "| Hardware | NVIDIA H100 80GB HBM3 (85.0 GB VRAM) |" in md
    assert "NVIDIA H200" not in md.split("Provenance")[0]
    same = render_markdown(load_results(write_jsonl(tmp_path / "b.jsonl", _on("NVIDIA H200", "NVIDIA H200"))))
    assert "## Results — NVIDIA H200\n" in same and "| Hardware | NVIDIA H200 (85.0 GB VRAM) |" in same
    short = render_markdown(load_results(write_jsonl(tmp_path / "c.jsonl", _on("NVIDIA B300 SXM6 AC", "B300"))))
    assert "## Results — B300\n" in short and "| Hardware | B300 (85.0 GB VRAM) |" in short


def test_a_cpu_row_is_its_declared_hardware_whatever_gpu_the_machine_has(tmp_path):
    rows = [cpu_row(method=m) for m in ("poros", "resident")]
    for r in rows:
        r["provenance"]["gpus"] = [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-x", "memory_gb": 85.0}]
    assert "## Results — CPU\n" in render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))


def test_a_ratio_between_rows_of_two_gpus_is_not_printed(tmp_path):
    """Resident measured on another GPU than poros: no ratio, `other GPU` and the note says why; Unsloth's, on
    poros's GPU, is printed (and three rows of one GPU, the control, print every ratio and no note)."""
    rows = three_methods()
    rows[1]["provenance"] = {**rows[1]["provenance"],
                             "gpus": [{**rows[1]["provenance"]["gpus"][0], "uuid": "GPU-other-uuid"}]}
    assert rows[1]["method"] == "resident"
    md = render_markdown(load_results(write_jsonl(tmp_path / "a.jsonl", rows)))
    (row,) = table_rows(md, "qwen2.5-32b", 14)
    assert row[7] == "other GPU" and row[8].endswith("×")
    assert "ran on different GPUs" in md
    same = render_markdown(load_results(write_jsonl(tmp_path / "b.jsonl", three_methods())))
    (row,) = table_rows(same, "qwen2.5-32b", 14)
    assert row[7].endswith("×") and "other GPU" not in same and "ran on different GPUs" not in same


def test_a_row_whose_passes_ran_on_two_gpus_prints_no_ratio(tmp_path):
    """poros's passes timed on two GPUs (a run in parts changed machines), its process's GPU the others': neither
    ratio is printed (the control: the same passes all on that one GPU print both)."""
    rows = three_methods()
    uuid = rows[0]["provenance"]["gpus"][0]["uuid"]
    rows[0]["pass_gpus"] = ["GPU-earlier-part", uuid, uuid]
    md = render_markdown(load_results(write_jsonl(tmp_path / "a.jsonl", rows)))
    (row,) = table_rows(md, "qwen2.5-32b", 14)
    assert row[7] == row[8] == "other GPU"
    assert "one row's passes ran on more than one" in md
    rows[0]["pass_gpus"] = [uuid, uuid, uuid]
    same = render_markdown(load_results(write_jsonl(tmp_path / "b.jsonl", rows)))
    assert "other GPU" not in same


def _passes(row: dict, seconds: list[float], gpus: list[str]) -> None:
    row["per_pass_s"], row["pass_gpus"] = seconds, gpus


def test_a_ratio_between_rows_timed_on_the_same_gpus_is_read_gpu_by_gpu(tmp_path):
    """A model whose cells ran a pass each on three GPUs (`--passes-per-part 1`): each ratio is the median of the
    three GPUs' own ratios, marked with their number and explained; the ratio of the rows' medians would differ
    (poros 15 s over resident 5 s: 3.00×, against 2, 2 and 3 GPU by GPU: 2.00×). Controls: a GPU where one row
    timed no pass, and rows whose passes name no GPU, print no ratio."""
    rows = three_methods()
    p, r, u = rows
    steps = p["steps"]
    _passes(p, [10.0, 20.0, 15.0], ["GPU-a", "GPU-b", "GPU-c"])
    _passes(r, [5.0, 10.0, 5.0], ["GPU-a", "GPU-b", "GPU-c"])
    _passes(u, [20.0, 20.0, 10.0], ["GPU-c", "GPU-a", "GPU-b"])  # in another order: paired by GPU, not by index
    for row in rows:
        row["s_per_step_median"] = statistics.median(row["per_pass_s"]) / steps
    md = render_markdown(load_results(write_jsonl(tmp_path / "a.jsonl", rows)))
    (row,) = table_rows(md, "qwen2.5-32b", 14)
    assert row[7] == "2.00× (3 GPUs)"  # 10/5, 20/10, 15/5
    assert row[8] == "0.75× (3 GPUs)"  # a: 10/20, b: 20/10, c: 15/20 -> 0.5, 2.0, 0.75
    assert "the median over those GPUs of the ratio on each GPU" in md and "other GPU" not in md
    _passes(r, [5.0, 10.0, 5.0], ["GPU-a", "GPU-b", "GPU-d"])  # control: resident never ran on GPU-c
    md = render_markdown(load_results(write_jsonl(tmp_path / "b.jsonl", rows)))
    (row,) = table_rows(md, "qwen2.5-32b", 14)
    assert row[7] == "other GPU" and row[8] == "0.75× (3 GPUs)"
    _passes(r, [5.0, 10.0, 5.0], ["GPU-a", None, "GPU-c"])  # control: a pass that names no GPU pairs nothing
    (row,) = table_rows(render_markdown(load_results(write_jsonl(tmp_path / "c.jsonl", rows))), "qwen2.5-32b", 14)
    assert row[7] == "other GPU"


def test_names_that_are_markdown_keep_every_table_whole(tmp_path, monkeypatch):
    """A checkpoint folder named `a|b<c>`, a plan and a stack with a newline, a backtick or `>`: every table of
    the matrix page and of the sweep page keeps its columns, and the names read as they are (`md_cell`). Negative
    control: the same rows through a table that escapes nothing break a table."""
    import poros.harness.report.format as fmt
    from tests.harness.test_report_sweep import row as sweep_row

    folder = tmp_path / "a|b<c>"
    folder.mkdir()
    rows = [fixture_row(model=str(folder), method=m, stack="torch 2.11 `dev\n<nightly>") for m in ("poros", "resident")]
    page = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert_tables_well_formed(page)
    assert f"| {str(tmp_path).replace('|', chr(92) + '|')}/a\\|b&lt;c&gt; |" in page and "<c>" not in page.split(
        "## Results")[1], page
    assert "| torch 2.11 \\`dev &lt;nightly&gt; |" in page, page
    plans = [sweep_row(plan="24GB|<b>\nx`y"), sweep_row(method="resident")]
    sweep = write_report([write_jsonl(tmp_path / "s.jsonl", plans)], tmp_path / "plans.md", sweep=True).read_text()
    assert_tables_well_formed(sweep)
    assert "24GB\\|&lt;b&gt; x\\`y" in sweep, sweep
    assert fmt.md_cell("`cpu`, `cpu-torch210` a<b") == "`cpu`, `cpu-torch210` a&lt;b", "a code span is kept"
    monkeypatch.setattr(fmt, "md_cell", lambda c: c)  # negative control: nothing escaped
    broken = render_markdown(load_results(write_jsonl(tmp_path / "r.jsonl", rows)))
    with pytest.raises(AssertionError, match="cells for"):
        assert_tables_well_formed(broken)
