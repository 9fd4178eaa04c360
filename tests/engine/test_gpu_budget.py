"""A budget holds what the driver counts for the process (NVML, what nvidia-smi shows), on one GPU:

    pytest -m gpu tests/engine/test_gpu_budget.py -s

qwen2.5-72b (fast attention, strict determinism) at 512 tokens with 24 and 40 GB, eager and under CUDA
graphs, and at 16,384 tokens with 24 GB (eager; under graphs the planner refuses it, naming the smallest
budget that holds). Each (length, budget) runs in a fresh process that builds the store once and then
runs each plan in turn (set-up and a few steps, its NVML peak sampled from the trainer's construction to
its last step), so a peak is that process's alone. The negative control runs the plan the planner made
before it counted the process (the tensors alone within 24 GB), under CUDA graphs and without the cap:
its NVML peak exceeds the budget, which is what the check would catch. Each run prints its JSON line.
`python -m tests.engine.test_gpu_budget SEQ BUDGET_GB` is one such process.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.capabilities import requires_gpu

MODEL = "qwen2.5-72b"
GB = 10**9
ROOT = Path(__file__).resolve().parents[2]
UNCAPPED = "tensors-only plan, uncapped"  # the negative control's variant


def config(seq: int, budget_gb: int, graphs: bool):
    from poros.config import TrainConfig

    long = seq > 512
    return TrainConfig(model=MODEL, seq_len=seq, block_size=4, device="cuda", attention="fast", deterministic=True,
                       vram_budget=budget_gb * GB, cuda_graphs=graphs, overlap_backward=not graphs and not long,
                       loss_chunk=4096 if long else None, offload_inputs=long)


def measure(store, cfg, variant: str, plan=None, steps: int = 3) -> dict:
    """Build a trainer for `cfg` (or `plan`), run `steps` steps; the NVML peak of the process meanwhile."""
    import torch

    from poros.engine.methods.executor import PorosTrainer
    from poros.engine.runtime.nvml import NvmlPeak
    from poros.errors import BudgetError

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row = {"seq_len": cfg.seq_len, "budget_gb": cfg.vram_budget / GB, "variant": variant}
    with NvmlPeak(interval=0.01) as nvml:
        try:
            trainer = PorosTrainer(store, cfg, plan=plan)
        except BudgetError as e:
            return {**row, "refused": str(e)}
        for _ in range(steps):
            trainer.step()
        torch.cuda.synchronize()
    m = trainer.plan.memory
    row.update(refused=None, nvml_peak_gb=nvml.peak / GB, nvml_source=nvml.source,
               allocated_peak_gb=torch.cuda.max_memory_allocated() / GB,
               reserved_peak_gb=torch.cuda.max_memory_reserved() / GB, predicted_gb=m.total / GB,
               predicted_allocated_gb=m.allocated / GB, predicted_parts_gb={k: v / GB for k, v in m.parts().items()},
               allocator_fraction=trainer.allocator_limit.fraction, resident_layers=len(trainer.plan.resident_layers),
               block_size=trainer.plan.block_size)
    trainer.close()
    del trainer
    return row


def worker(seq: int, budget_gb: int) -> None:
    """One process: the store once, then each plan for (seq, budget); one JSON line each."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: strict determinism
    from poros.engine.planning.memory import ProcessCosts
    from poros.engine.planning.search import PlanRequest
    from poros.engine.planning.budget import plan_for_budget
    from poros.engine.methods.executor import geometry_of_store
    from poros.store.build import build_store

    store, _ = build_store(MODEL, device="cuda", progress=False)
    steps = 3 if seq == 512 else 2
    for graphs in (False, True):
        print(json.dumps(measure(store, config(seq, budget_gb, graphs), "graphs" if graphs else "eager",
                                 steps=steps)), flush=True)
    if seq == 512 and budget_gb == 24:
        cfg = config(seq, budget_gb, True)
        request = replace(PlanRequest.of_config(cfg), process=ProcessCosts())  # the tensors alone
        old = replace(plan_for_budget(geometry_of_store(store, cfg), request), budget=None)  # no cap either
        print(json.dumps(measure(store, cfg, UNCAPPED, plan=old, steps=steps)), flush=True)


@pytest.fixture(scope="module")
def runs():
    """(seq, budget) -> {variant: row}, each (seq, budget) one fresh process, run when first asked for."""
    cache: dict[tuple[int, int], dict[str, dict]] = {}

    def get(seq: int, budget_gb: int) -> dict[str, dict]:
        if (seq, budget_gb) not in cache:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run([sys.executable, "-m", "tests.engine.test_gpu_budget", str(seq), str(budget_gb)],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
            assert proc.returncode == 0, f"seq {seq}, {budget_gb} GB: the process failed\n{proc.stderr[-4000:]}"
            rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            for row in rows:
                print(json.dumps(row))
            cache[(seq, budget_gb)] = {r["variant"]: r for r in rows}
        return cache[(seq, budget_gb)]

    return get


CASES = [(512, 24, "eager"), (512, 24, "graphs"), (512, 40, "eager"), (512, 40, "graphs"), (16384, 24, "eager"),
         (16384, 24, "graphs")]


@pytest.mark.gpu
@requires_gpu(1)
@pytest.mark.parametrize("seq,budget_gb,variant", CASES,
                         ids=[f"model={MODEL}-seq={s}-budget={b}GB-{v}" for s, b, v in CASES])
def test_the_process_stays_within_its_budget(runs, seq, budget_gb, variant):
    row = runs(seq, budget_gb)[variant]
    if row["refused"] is not None:  # only a plan the planner cannot fit is refused, naming the smallest that is
        assert variant == "graphs" and seq > 512, row["refused"]
        smallest = float(row["refused"].split("use --vram-budget ")[1].split("GB")[0])
        assert smallest > budget_gb
        return
    assert row["nvml_source"] == "process", "NVML does not list this process: the peak would be the device's"
    assert row["nvml_peak_gb"] <= budget_gb, row
    assert row["predicted_gb"] <= budget_gb and row["allocator_fraction"] is not None
    assert row["reserved_peak_gb"] <= budget_gb - row["predicted_parts_gb"]["context"] + 1e-9, row


@pytest.mark.gpu
@requires_gpu(1)
def test_negative_control_the_tensors_only_plan_uncapped_exceeds_the_budget(runs):
    """The same check fails for the plan that fits only its tensors within 24 GB, run without the cap."""
    row = runs(512, 24)[UNCAPPED]
    assert row["refused"] is None and row["predicted_allocated_gb"] <= 24
    assert row["allocator_fraction"] is None
    assert row["nvml_peak_gb"] > 24, row


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]))
