"""Plans pinned: for a handful of registered shapes and settings, the planner's summary, its text and its
operations are those recorded in plan_pins.json. A change to the planner that moves any plan shows here;
one made on purpose re-records them (`python -m tests.engine.test_plan_pins`)."""

from __future__ import annotations

import hashlib
import json
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from poros.config import TrainConfig
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.memory import DeviceMemory
from poros.engine.planning.plan import describe
from poros.engine.planning.budget import make_plan
from poros.models.checkpoint import resolve

PINS = Path(__file__).with_name("plan_pins.json")
GB = 10**9

# (id, TrainConfig settings, the device as a run finds it: total, free, held, context; or None)
CASES = [
    ("qwen2.5-72b-streamed", dict(model="qwen2.5-72b", device="cuda"), None),
    ("qwen2.5-72b-40gb-graphs-kept-spread", dict(
        model="qwen2.5-72b", device="cuda", vram_budget="40GB", cuda_graphs=True, keep_activations=True,
        kept_layers=12, placement="spread", attention="fast", deterministic=True, compile=True), None),
    ("qwen2.5-72b-40gb-accum8-micro-offload", dict(
        model="qwen2.5-72b", device="cuda", vram_budget="40GB", grad_accum=8, accumulation="micro", seq_len=2048,
        offload_inputs=True, attention="math", block_size=2), None),
    ("gemma4-31b-18gb-2-ranks-shared-dq", dict(
        model="gemma4-31b", device="cuda", vram_budget="18GB", gpus=2, shard_stream=True, double_quant=True,
        loss_chunk=1024, keep_attention=True, overlap_backward=False, lora_rank=32), None),
    ("tiny-qwen3-cpu-13mb-accum4", dict(
        model="tiny-qwen3", block_size=2, grad_accum=4, lora_rank=64, seq_len=256, vram_budget="13.4MB"), None),
    ("tiny-gemma4-auto", dict(model="tiny-gemma4", device="cuda", vram_budget="auto", seq_len=256,
                              lora_targets="q_proj,v_proj"), (2 * GB, int(1.0357 * GB), 10**7, 3 * 10**8)),
    ("qwen2.5-72b-64k-36gb-input-stride-2", dict(
        model="qwen2.5-72b", device="cuda", vram_budget="36GB", host_budget="120GB", seq_len=65536, input_stride=2,
        attention="fast", deterministic=True, lora_compute="bf16", loss_chunk=2048, mlp_chunk=2048,
        attention_chunk=2048, overlap_backward=False, compile=True, compile_mlp=False), None),
]


@lru_cache(maxsize=None)
def _geometry(model: str, targets: tuple[str, ...], double_quant: bool) -> Geometry:
    return Geometry.of_config(model, resolve(model).config, targets, double_quant)


def pin(settings: dict, device: tuple | None) -> dict:
    """What is pinned of the plan `settings` make: its summary, its text and a digest of its operations."""
    cfg = TrainConfig(**settings)
    geo = _geometry(cfg.model, cfg.lora_targets, cfg.double_quant)
    mem = DeviceMemory(*device) if device else None
    plan = make_plan(geo, cfg, mem)
    ops = " ".join(map(str, plan.setup)) + " | " + " ".join(map(str, plan.step))
    return {"summary": json.loads(json.dumps(plan.summary())), "describe": describe(plan).splitlines(),
            "ops_sha256": hashlib.sha256(ops.encode()).hexdigest(), "ops": len(plan.setup) + len(plan.step)}


@pytest.fixture(scope="module")
def pins() -> dict:
    return json.loads(PINS.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_is_the_pinned_one(case, pins):
    name, settings, device = case
    got, want = pin(settings, device), pins[name]
    for key in want:
        assert got[key] == want[key], f"{name}: {key} moved"


def test_pins_tell_the_plans_apart(pins):
    """Negative control: the pins differ from each other, and one setting changed moves a pinned plan."""
    digests = [pins[c[0]]["ops_sha256"] for c in CASES]
    assert len(set(digests)) == len(digests)
    name, settings, device = CASES[1]
    moved = pin({**settings, "kept_layers": 11}, device)
    assert moved["summary"] != pins[name]["summary"]


if __name__ == "__main__":  # re-record the pins
    PINS.write_text(json.dumps({c[0]: pin(c[1], c[2]) for c in CASES}, indent=1) + "\n")
    print(f"wrote {PINS}", file=sys.stderr)
