"""Records edited or damaged by hand (poros/harness/record_schema.py): every reader of results.jsonl and passes.jsonl
checks each record against its schema and refuses one it cannot use in one line naming the file, the line and the
field; every record the repository holds reads as it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poros.cli import main
from poros.harness.record_schema import pass_problems, row_problems
from poros.harness.results import PassLog, ResultsFileError, ResultsWriter
from tests.harness.test_results import whole_row

ROOT = Path(__file__).resolve().parents[2]
PART = {"kind": "part", "cell": "", "fingerprint": "", "commit": None, "part_id": "1-2", "started": 0.0, "ended": 5.0,
        "wall_s": 5.0, "phases": {"timed passes": 4.0}, "exit_status": 0, "stopped": False, "gpu": []}
PASS = {"kind": "pass", "cell": "c", "fingerprint": "f", "commit": None, "index": 0, "seconds": 1.5, "counters": []}
MATRIX = ROOT / "matrices" / "cpu.yaml"


@pytest.mark.parametrize("record, field", [
    ({**PART, "wall_s": "12"}, "field wall_s: expected a finite number of seconds >= 0 or null, got '12'"),
    ({**PART, "phases": {"timed passes": "4"}}, "field phases: expected a mapping of phase name to seconds"),
    ({**PART, "gpu": "GPU-1"}, "field gpu: expected a list of GPU UUIDs"),
    ({**PART, "started": 1e20}, "field started: expected seconds since the epoch (0 to 253402300799, the year 9999)"),
    ({**PART, "steps": 0, "passes": 2}, "field steps: expected an integer >= 1 or null, got 0"),
    ({**PART, "max_minutes": float("nan")}, "field max_minutes: expected a positive finite number or null, got nan"),
    ({**PASS, "process": {"host": "h", "pid": 1, "started": -1}}, "field process: expected a mapping of host"),
    ({**PASS, "index": -1}, "field index: expected an integer >= 0, got -1"),
    ({**PASS, "index": True}, "field index: expected an integer >= 0, got True"),
    ({**PASS, "seconds": float("nan")}, "field seconds: expected a finite number of seconds >= 0, got nan"),
    ({k: v for k, v in PASS.items() if k != "seconds"}, "field seconds: missing"),
    ({**PASS, "kind": "lap"}, "field kind: expected pass or gate or reference or part, got 'lap'"),
    ({"kind": "gate", "cell": "g", "fingerprint": "f", "result": {"parity": "PASS"}}, "its steps: missing"),
])
def test_a_damaged_pass_record_is_refused_naming_file_line_and_field(tmp_path, record, field):
    path = tmp_path / "passes.jsonl"
    path.write_text(json.dumps(PART) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ResultsFileError) as e:
        PassLog(path).records()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: ") and field in msg, msg
    # negative control: the whole record of the same kind reads
    path.write_text(json.dumps(PART) + "\n" + json.dumps(PASS) + "\n")
    assert len(PassLog(path).records()) == 2


@pytest.mark.parametrize("fields, field", [
    ({"per_pass_s": ["1.0", 2.0]}, "field per_pass_s: expected a list of positive finite seconds"),
    ({"per_pass_s": [1.0, 0.0]}, "field per_pass_s: expected a list of positive finite seconds"),
    ({"s_per_step_median": float("nan")}, "field s_per_step_median: expected a positive finite number or null, got nan"),
    ({"s_per_step_median": -1}, "field s_per_step_median: expected a positive finite number or null, got -1"),
    ({"s_per_step_median": 0}, "field s_per_step_median: expected a positive finite number or null, got 0"),
    ({"tokens_per_s": float("inf")}, "field tokens_per_s: expected a positive finite number or null, got inf"),
    ({"s_per_step_std": -0.5}, "field s_per_step_std: expected a finite number >= 0 or null, got -0.5"),
    ({"steps": 2.5}, "field steps: expected an integer >= 1 or null, got 2.5"),
    ({"passes": 0}, "field passes: expected an integer >= 1 or null, got 0"),
    ({"warmup_passes": -1}, "field warmup_passes: expected an integer >= 0 or null, got -1"),
    ({"parity": "pass"}, "field parity: expected PASS or FAIL or null, got 'pass'"),
    ({"parity_max_abs_diff": float("nan")}, "field parity_max_abs_diff: expected a number >= 0 (or Infinity) or null"),
    ({"provenance": {"gpus": "x"}}, "field provenance: expected a mapping (its gpus: expected a list of mappings"),
    ({"provenance": {"versions": [1]}}, "field provenance: expected a mapping (its versions: expected a mapping"),
    ({"config": {"seq_len": "x"}}, "field config: expected a mapping of settings (its seq_len: expected an integer"),
    ({"config": {"lora_rank": [1]}}, "field config: expected a mapping of settings (its lora_rank:"),
    ({"sweep": [1]}, "field sweep: expected a mapping or null"),
])
def test_a_damaged_results_row_is_refused_by_every_reader(tmp_path, fields, field):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(whole_row()) + "\n" + json.dumps(whole_row(**fields)) + "\n")
    with pytest.raises(ResultsFileError, match=f"^{path}:2: ") as e:
        ResultsWriter(path).rows()
    assert field in str(e.value) and "\n" not in str(e.value)
    from poros.errors import PorosError
    from poros.harness.report import load_results

    with pytest.raises(PorosError, match=f"^{path}:2: ") as e:
        load_results([path])
    assert field in str(e.value)
    path.write_text(json.dumps(whole_row()) + "\n")  # negative control
    assert len(ResultsWriter(path).rows()) == 1


def test_bench_status_over_a_hand_edited_part_is_one_line_not_a_traceback(tmp_path, capsys):
    (tmp_path / "passes.jsonl").write_text(json.dumps({**PART, "wall_s": "12"}) + "\n")
    assert main(["bench", "status", str(MATRIX), "-o", str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'passes.jsonl'}:1: field wall_s" in err, err
    (tmp_path / "passes.jsonl").write_text(json.dumps({**PART, "phases": {"warm-up": "x"}}) + "\n")
    assert main(["bench", "status", str(MATRIX), "-o", str(tmp_path)]) != 0
    assert "field phases" in capsys.readouterr().err
    (tmp_path / "passes.jsonl").write_text(json.dumps(PART) + "\n")  # negative control: the record as written
    assert main(["bench", "status", str(MATRIX), "-o", str(tmp_path)]) == 0
    assert "| 1 |" in capsys.readouterr().out


def test_every_committed_record_reads():
    """Rows and pass records of earlier harnesses lack later fields: they read, the new fields absent."""
    files = sorted(ROOT.glob("results/**/*.jsonl")) + sorted(ROOT.glob("experiments/**/passes.jsonl")) + \
        sorted(ROOT.glob("experiments/**/results.jsonl"))
    assert len(files) > 20
    for path in files:
        check = pass_problems if path.name == "passes.jsonl" else row_problems
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                assert check(json.loads(line)) == [], f"{path}:{n}"


@pytest.mark.parametrize("line, why", [
    ("[" * 100_000, "not valid JSON (nested deeper than the reader reaches)"),
    ('{"steps": ' + "1" * 5000 + "}", "not valid JSON (Exceeds the limit (4300 digits)"),
    ("{'steps': 1}", "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
], ids=["nested-too-deep", "number-too-long", "python-dict"])
def test_a_line_no_json_reader_can_take_is_one_line_naming_file_and_line(tmp_path, capsys, line, why):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(whole_row()) + "\n" + line + "\n")
    assert main(["report", str(path), "-o", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2: {why}" in err, err
    path.write_text(json.dumps(whole_row()) + "\n")  # negative control: the whole row alone reads
    from poros.harness.report import load_results

    assert len(load_results([path])) == 1


def test_a_row_whose_settings_and_provenance_are_whole_reads():
    """Negative control of the config and provenance kinds: the values a run writes pass."""
    assert row_problems(whole_row(config={"seq_len": 64, "lora_rank": 4, "vram_budget": "auto", "unknown": [1]},
                                  provenance={"gpus": [{"name": "cpu"}], "versions": {}, "git": None})) == []
