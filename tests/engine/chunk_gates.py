"""What the gates of the chunked modules (`mlp_chunk`, `attention_chunk`: tests/engine/test_mlp_chunk.py,
test_attention_chunk.py) share: their settings, the PASS they require, and the gates through layer templates and
compiled layers, each run with the chunks a test names."""

from __future__ import annotations

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.executor import PorosTrainer, geometry_of_store
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import run_gate
from poros.engine.planning.search import build_plan
from poros.engine.methods.trainer import ResidentTrainer
from tests.engine.test_graphs import stand_in_graphs
from tests.plans import plan_request

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]
SEQ, STEPS = 128, 3


def config(model: str, **settings) -> TrainConfig:
    return TrainConfig(model=model, **{"seq_len": SEQ, "block_size": 2, "grad_accum": 2, "lr": 1e-2, **settings})


def assert_pass(result, steps: int = STEPS) -> None:
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    assert result.steps == steps and result.max_abs_diff == 0.0


def templates_gate(stores, monkeypatch, capture: bool, keep: bool, **chunks) -> None:
    """poros through layer templates (eager, or on the capture path with CPU stand-ins for the CUDA graph API;
    `keep`: two resident layers keep their activations) against resident, tiny-qwen3 with `chunks`: PASS, no
    template fallen back or failed capture, every template captured where capturing."""
    if capture:
        stand_in_graphs(monkeypatch)
    store = stores("tiny-qwen3")
    cfg = config("tiny-qwen3", keep_activations=keep, **chunks)
    plan = build_plan(geometry_of_store(store, cfg), plan_request(cfg, block_size=2, resident_layers=2 if keep else 0))
    poros = PorosTrainer(store, cfg, plan=plan)
    poros.use_layer_templates(capture=capture)
    assert_pass(run_gate(ResidentTrainer(store, cfg), poros, STEPS))
    c = poros.counters()
    assert c["template_fallbacks"] == 0 and c["capture_errors"] == 0 and c["layer_templates"] > 0
    assert c["kept_templates"] == (2 * cfg.grad_accum if keep else 0)
    assert c["graphs_captured"] == (c["layer_templates"] + c["forward_templates"] + c["kept_templates"]
                                    if capture else 0)


def compiled_gate(stores, side: str, **chunks) -> None:
    """Compiled `side` (poros, poros-templates or resident_gc) against compiled resident, tiny-qwen2 with
    `chunks`, two steps: PASS."""
    store = stores("tiny-qwen2")
    cfg = config("tiny-qwen2", compile=True, **chunks)
    if side == "resident_gc":
        other = make_trainer(Method.RESIDENT_GC, store, cfg)
    else:
        other = PorosTrainer(store, cfg)
        if side == "poros-templates":
            other.use_layer_templates(capture=False)
    assert_pass(run_gate(ResidentTrainer(store, cfg), other, 2), steps=2)


def shift_chunks(module: torch.nn.Module, chunk: int) -> None:
    """Break a chunked module (negative controls): every chunk after the first reads its token range one token
    early (the token before it twice, the sequence's last one never)."""
    forward = type(module).forward.__get__(module)

    def shifted(x, *args, **kwargs):
        return torch.cat([forward(x.narrow(-2, max(start - 1, 0), min(chunk, x.shape[-2] - start)))
                          for start in range(0, x.shape[-2], chunk)], dim=-2)

    module.forward = shifted
