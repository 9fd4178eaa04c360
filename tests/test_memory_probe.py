"""scripts/memory_probe.py on the CPU: a model cut to a few layers, its plan's parts and one measured step (the
measured peaks exist on CUDA only)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from poros.config import TrainConfig
from poros.engine.methods.executor import geometry_of_store
from poros.engine.planning.budget import make_plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe_module():
    spec = importlib.util.spec_from_file_location("memory_probe", ROOT / "scripts" / "memory_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cut_model_has_the_layers_asked_and_its_plan_is_the_planners(probe_module):
    store = probe_module.cut_store("tiny-qwen2", 2, "cpu")
    assert store.config.num_hidden_layers == 2
    cfg = TrainConfig(model="tiny-qwen2", seq_len=128, block_size=1, device="cpu", mlp_chunk=64, loss_chunk=64)
    row = probe_module.probe(store, cfg)
    plan = make_plan(geometry_of_store(store, cfg), cfg)
    assert row["predicted"]["allocated"] == plan.memory.allocated
    geo = geometry_of_store(store, cfg)
    head, layer = row["predicted"]["head_transient"], row["predicted"]["layer_transient"]
    # the plan's transient: the head's, or the (two overlapped) layers' with the gradient in flight to the layer below
    assert row["predicted"]["transient"] == max(head, layer + cfg.seq_len * geo.hidden * 2)
    assert row["measured"] == {"allocated": None, "reserved": None, "process": None}  # nothing to measure on the CPU
    assert row["s_per_step"] > 0
    assert row["provenance"]["torch"] == torch.__version__  # the stack that measured it


def test_each_length_and_loss_chunk_is_a_case_and_a_row(probe_module, tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.jsonl"
    monkeypatch.setattr("sys.argv", ["memory_probe.py", "tiny-qwen2", "--layers", "2", "--seq-lens", "64,256",
                                     "--loss-chunk", "none,64", "--attention", "default", "--device", "cpu",
                                     "--out", str(out)])
    probe_module.main()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["seq_len"], r["loss_chunk"]) for r in rows] == [(64, None), (64, 64), (256, None), (256, 64)]
    assert not any("error_text" in r for r in rows)
    assert rows[2]["predicted"]["layer_transient"] > rows[0]["predicted"]["layer_transient"]
    # the head's logits 64 tokens at a time: a quarter of the 256-token head's
    assert rows[3]["predicted"]["head_transient"] * 4 == rows[2]["predicted"]["head_transient"]
    assert capsys.readouterr().out.count("\n") == 4  # each row on stdout as well


@pytest.mark.parametrize("argv, says", [(["--layers", "9"], "--layers: tiny-qwen2 has 5 decoder layers"),
                                        (["--seq-lens", "64,x"], "--seq-lens"),
                                        (["--loss-chunk", "64,all"], "--loss-chunk: expected .* or none"),
                                        (["--compile", "yes,sometimes"], "--compile: expected yes, no, mlp-eager"),
                                        (["--variant", "nonsense=1"], "variant")])
def test_bad_arguments_are_refused_with_the_reason(probe_module, monkeypatch, argv, says):
    monkeypatch.setattr("sys.argv", ["memory_probe.py", "tiny-qwen2", "--device", "cpu", *argv])
    with pytest.raises(SystemExit, match=says):
        probe_module.main()


def test_each_operation_kind_keeps_its_largest_peak_and_what_it_added(probe_module, monkeypatch):
    """OpPeaks on the CPU with torch's CUDA memory counters simulated: the head adds 300 bytes above what it found
    and backwards 100 + 10 x layer; the largest of each kind is kept with its layer, the overall peak is the
    largest, and the trainer's own methods are back afterwards."""
    from poros.engine.methods.executor import PorosTrainer

    mem = {"now": 1000, "peak": 1000}
    for name, fn in {"memory_allocated": lambda *a: mem["now"], "max_memory_allocated": lambda *a: mem["peak"],
                     "max_memory_reserved": lambda *a: mem["peak"] + 7,
                     "reset_peak_memory_stats": lambda *a: mem.update(peak=mem["now"])}.items():
        monkeypatch.setattr(f"torch.cuda.{name}", fn)

    def adding(method, extra):
        def run(self, op):
            mem["peak"] = max(mem["peak"], mem["now"] + extra(op))
            return method(self, op)
        return run

    monkeypatch.setattr(PorosTrainer, "_head", adding(PorosTrainer._head, lambda op: 300))
    monkeypatch.setattr(PorosTrainer, "_backward", adding(PorosTrainer._backward, lambda op: 100 + 10 * op.layer))
    store = probe_module.cut_store("tiny-qwen2", 3, "cpu")
    trainer = PorosTrainer(store, TrainConfig(model="tiny-qwen2", seq_len=64, block_size=1, device="cpu"))
    try:
        with probe_module.OpPeaks(trainer) as ops:
            trainer.step()
        assert "_head" not in vars(trainer) and "_backward" not in vars(trainer)
    finally:
        trainer.close()
    assert ops.peaks["head"] == {"peak": 1300, "added": 300, "layer": -1}  # the head's op names no layer
    assert ops.peaks["backward"]["added"] == 120 and ops.peaks["backward"]["layer"] == 2
    assert ops.peaks["forward"]["added"] == 0
    assert (ops.allocated, ops.reserved) == (1300, 1307)
