"""scripts/sweep.py end to end on the CPU: the reference recorded, its control, each plan gated then
timed, several sequence lengths on one store build; and the same under torchrun on two gloo ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from poros.harness.ranks import launch_env, torchrun

pytestmark = pytest.mark.slow  # scripts/sweep.py end to end in subprocesses, one under torchrun

REPO = Path(__file__).resolve().parents[2]
SWEEP = ["scripts/sweep.py", "tiny-qwen3", "--resident", "--control", "--variant", "block_size=2", "--steps", "1",
         "--passes", "1", "--gate-steps", "1", "--device", "cpu"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]


def _run(cmd, tmp_path):
    proc = subprocess.run(cmd + ["--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=launch_env(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _rows(tmp_path), proc.stderr


def test_one_build_serves_every_length_and_attention_and_each_plan_is_gated(tmp_path):
    rows, log = _run([sys.executable] + SWEEP + ["--seq-len", "64,128", "--attention", "math,fast"], tmp_path)
    assert log.count("store ready") == 1
    assert [(r["method"], r["attention"], r["seq_len"]) for r in rows] == [
        (m, a, s) for a in ("math", "fast") for s in (64, 128) for m in ("resident (control)", "resident", "poros")]
    for r in rows:
        assert r["world_size"] == 1
        if r["method"] != "resident":
            assert r["parity"] == "PASS", r
        if "control" not in r["method"]:
            assert r["s_per_step_median"] > 0 and r["attention_backends"]
            # device peaks: allocated, reserved (graph pools) and NVML's; none on the CPU
            assert {k: r[k] for k in ("peak_vram_gb", "peak_reserved_gb", "peak_vram_nvml_gb")} == dict.fromkeys(
                ("peak_vram_gb", "peak_reserved_gb", "peak_vram_nvml_gb"))


def _tokens_agree(row: dict, tokens_per_step: int) -> bool:
    """tokens/s is tokens_per_step / s_per_step, up to the rows' rounding (s to 1e-4, tokens/s to 0.1)."""
    s = row["s_per_step_median"]
    return abs(row["tokens_per_s"] - tokens_per_step / s) <= 0.05 + tokens_per_step * 5e-5 / (s - 5e-5) ** 2


def test_under_torchrun_every_rank_is_gated_and_tokens_count_both(tmp_path):
    cmd = torchrun(2) + SWEEP + ["--seq-len", "64", "--alone"]
    rows, log = _run(cmd, tmp_path)
    assert len(rows) == 4  # rank 0 writes; rank 1 only logs its stages
    assert "[sweep rank 1/2" in log and "waiting for rank 0 alone" in log
    ranked, alone = rows[:3], rows[3]
    for r in ranked:
        assert r["world_size"] == 2
        if r["method"] != "resident":
            assert r["parity"] == "PASS", r
    timed = next(r for r in ranked if r["method"] == "poros")
    assert _tokens_agree(timed, 2 * 64)
    assert timed["allreduce_bytes_per_step"] > 0 and "allreduce_bytes_per_step" not in alone
    # the one-GPU figure: rank 0's own micro-batch a step, same plan, same process
    assert (alone["method"], alone["world_size"], alone["alone_of"]) == ("poros", 1, 2)
    assert alone["gate"].endswith("(under 2 ranks)") and "ranks" not in alone
    assert _tokens_agree(alone, 64)


def test_a_sweep_stopped_while_timing_writes_what_it_reached(tmp_path):
    """SIGTERM (what `timeout` sends) during a plan's timing: the row keeps the gate's verdict and says it
    was stopped; the sweep ends."""
    import signal

    cmd = [sys.executable, "scripts/sweep.py", "tiny-qwen3", "--variant", "block_size=2", "--steps", "500", "--passes",
           "1", "--gate-steps", "1", "--device", "cpu", "--seq-len", "64", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(1), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    for line in proc.stderr:
        if "PASS; timing" in line:
            proc.send_signal(signal.SIGTERM)
            break
    proc.stderr.read()
    assert proc.wait(timeout=120) != 0
    (row,) = _rows(tmp_path)
    assert row["method"] == "poros" and row["parity"] == "PASS"
    assert row["error"].startswith("Stopped: stopped by signal") and row["error"].endswith("(during timing)")
