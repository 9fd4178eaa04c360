"""A budget with CUDA-graph layers that the planner accepts runs within it, down to the smallest it names, on one GPU:

    pytest -m gpu tests/engine/test_gpu_smallest_budget.py -s

qwen3-32b at 512 tokens on the settings `poros train` resolves on CUDA (poros/resolve.py: fast attention under
strict determinism, CUDA-graph layers), compiled with LoRA in bf16 as the fastest matrices run it. `poros plan
--smallest-budget --json` names the smallest budget on this machine; one fresh process then builds the store and runs
three steps of each plan in turn (that budget, and 12 GB, half of Unsloth's process memory on this model), its NVML
peak sampled from the trainer's construction to its last step (tests/engine/test_gpu_budget.py `measure`). The
negative control asks for one budget step (100 MB) less than the smallest: the trainer refuses it before any work,
naming a budget that holds. Each run prints its JSON line. `python -m tests.engine.test_gpu_smallest_budget BUDGET...`
(bytes) is the process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.capabilities import requires_gpu
from tests.engine.test_gpu_budget import GB, ROOT, measure

MODEL = "qwen3-32b"
HALF = 12 * GB  # half of Unsloth's process memory on this model at seq 512 (matrices/h100-fastest.yaml)
STEP = 10**8  # poros plan's budget step


def config(budget: int):
    from poros.config import TrainConfig
    from poros.resolve import with_defaults

    values, _ = with_defaults({"device": "cuda", "compile": True, "lora_compute": "bf16", "vram_budget": budget})
    return TrainConfig(model=MODEL, seq_len=512, **values)


def worker(budgets: list[int]) -> None:
    """One process: the store once, then each budget's trainer in turn; one JSON line each."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: strict determinism
    from poros.store.build import build_store

    store, _ = build_store(MODEL, device="cuda", progress=False)
    for budget in budgets:
        cfg = config(budget)
        assert cfg.cuda_graphs, "the CUDA default takes graphs"
        print(json.dumps({**measure(store, cfg, str(budget)), "budget": budget}), flush=True)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")}


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    """'smallest', 'half' and 'below' -> the process's row of that budget."""
    plan = subprocess.run([sys.executable, "-m", "poros", "plan", "--model", MODEL, "--device", "cuda", "--compile",
                           "--lora-compute", "bf16", "--smallest-budget", "--json"],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-4000:]
    smallest = json.loads(plan.stdout)["smallest_vram_budget_bytes"]
    budgets = {"smallest": smallest, "half": HALF, "below": smallest - STEP}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_gpu_smallest_budget",
                           *(str(b) for b in budgets.values())],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"the process failed\n{proc.stderr[-4000:]}"
    found = {int(r["budget"]): r for r in (json.loads(line) for line in proc.stdout.splitlines()
                                           if line.startswith("{"))}
    for r in found.values():
        print(json.dumps(r))
    return {name: found[b] for name, b in budgets.items()}


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("name", ["smallest", "half"])
def test_a_graph_plan_the_planner_accepts_runs_within_its_budget(rows, name):
    row = rows[name]
    assert row["refused"] is None, row["refused"]
    assert row["nvml_source"] == "process", "NVML does not list this process: the peak would be the device's"
    assert row["nvml_peak_gb"] <= row["budget_gb"], row
    assert row["predicted_gb"] <= row["budget_gb"] and row["allocator_fraction"] is not None


@pytest.mark.gpu
@requires_gpu(1)
def test_negative_control_below_the_smallest_budget_is_refused_before_any_work(rows):
    """The same process asked one budget step below the smallest `poros plan` named: refused, naming one that holds."""
    row = rows["below"]
    assert row["refused"] is not None and "--vram-budget" in row["refused"], row


if __name__ == "__main__":
    worker([int(b) for b in sys.argv[1:]])
