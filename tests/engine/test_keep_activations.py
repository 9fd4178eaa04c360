"""`keep_activations`: resident layers keep their forward's activations for their backward instead of
recomputing them (resident QLoRA's own arithmetic). Exact for every order of accumulation, with and
without layer templates; a plan that keeps a streamed layer's activations is refused; mixing up kept
activations FAILs the gate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from poros.engine.planning import plan as P
from poros.engine.planning.rules import check
from poros.engine.planning.search import build_plan
from poros.config import TrainConfig
from poros.errors import CapabilityError, ConfigError
from poros.engine.methods.executor import PorosTrainer, geometry_of_store
from poros.engine.verify.parity import run_gate
from poros.engine.methods.trainer import ResidentTrainer
from tests.plans import plan_request


def _plan(store, cfg, resident_layers=2):
    return build_plan(geometry_of_store(store, cfg), plan_request(cfg, resident_layers=resident_layers,
                                                                  keep_activations=True))


@pytest.mark.parametrize("grad_accum,accumulation", [(1, "layer"), (2, "layer"), (2, "micro")])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_kept_activations_keep_parity(stores, model, grad_accum, accumulation):
    store = stores(model)
    cfg = TrainConfig(model=model, seq_len=64, grad_accum=grad_accum, accumulation=accumulation, block_size=2,
                      lr=1e-2, keep_activations=True)
    plan = _plan(store, cfg)
    assert plan.kept_layers == tuple(plan.resident_layers) and len(plan.kept_layers) == 2
    result = run_gate(ResidentTrainer(store, cfg), PorosTrainer(store, cfg, plan=plan), 2)
    assert result.ok, result.first_mismatch


@pytest.mark.parametrize("grad_accum,accumulation", [(1, "layer"), (2, "layer"), (2, "micro")])
def test_kept_layers_run_in_their_own_templates(stores, grad_accum, accumulation):
    """With layer templates a kept layer runs its forward with autograd and, later, its backward in a
    template of its own per micro-batch; the streamed layers keep theirs."""
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=grad_accum, accumulation=accumulation, block_size=2,
                      lr=1e-2, keep_activations=True)
    poros = PorosTrainer(store, cfg, plan=_plan(store, cfg))
    poros.use_layer_templates(capture=False)
    result = run_gate(ResidentTrainer(store, cfg), poros, 2)
    assert result.ok, result.first_mismatch
    kept, shared = poros.templates.kept, poros.templates.templates.values()
    assert sorted(kept) == [(i, m) for i in poros.plan.kept_layers for m in range(grad_accum)]
    assert sum(t.replays for t in kept.values()) == len(kept) * 2  # one backward a step, two steps
    assert sum(t.replays for t in shared) == 2 * len(poros.plan.streamed_layers) * grad_accum * 2
    c = poros.counters()
    assert c["template_fallbacks"] == 0 and c["kept_templates"] == len(kept)


def test_mixed_up_kept_templates_fail_the_gate(stores):
    """Negative control: each kept layer's backward runs from the other micro-batch's template."""

    class Swapped(PorosTrainer):
        def _backward(self, op):
            kept = self.templates.kept
            a, b = (op.layer, 0), (op.layer, 1)
            if op.micro == 0 and a in kept and b in kept:
                kept[a], kept[b] = kept[b], kept[a]
            super()._backward(op)

    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2, block_size=2, lr=1e-2, keep_activations=True)
    poros = Swapped(store, cfg, plan=_plan(store, cfg))
    poros.use_layer_templates(capture=False)
    assert not run_gate(ResidentTrainer(store, cfg), poros, 1).ok


def test_kept_templates_on_the_capture_path(stores, monkeypatch):
    """The capture-mode control flow with stand-ins for the CUDA graph API (tests/engine/test_graphs.py): each
    kept template captures its forward and its backward once and replays both every step; parity holds.
    A backward whose capture fails runs the same backward eagerly from the captured forward's graph (and the
    layer then leaves its template: the next test)."""
    from tests.engine.test_graphs import stand_in_graphs

    stand_in_graphs(monkeypatch)
    store = stores("tiny-gemma3")
    cfg = TrainConfig(model="tiny-gemma3", seq_len=64, grad_accum=2, block_size=2, lr=1e-2, keep_activations=True)
    poros = PorosTrainer(store, cfg, plan=_plan(store, cfg))
    poros.use_layer_templates(capture=True)
    assert run_gate(ResidentTrainer(store, cfg), poros, 2).ok
    kept = poros.templates.kept.values()
    assert len(kept) == 4 and all(set(t.graphs) == {"forward", "backward"} for t in kept)
    assert all(t.graphs["forward"].replays == 2 and t.graphs["backward"].replays == 2 for t in kept)
    assert poros.counters()["capture_errors"] == 0

    import poros.engine.runtime.templates as g

    real = g.KeptTemplate._body

    def no_backward_capture(self):
        if self.phase == "backward" and "backward" not in self.graphs and self.capture_failing:
            self.capture_failing = False
            raise RuntimeError("operation not permitted when stream is capturing")
        real(self)

    monkeypatch.setattr(g.KeptTemplate, "capture_failing", True, raising=False)
    monkeypatch.setattr(g.KeptTemplate, "_body", no_backward_capture)
    poros = PorosTrainer(store, cfg, plan=_plan(store, cfg))
    poros.use_layer_templates(capture=True)
    with pytest.warns(UserWarning, match="capture failed, running the kept layer eagerly"):
        result = run_gate(ResidentTrainer(store, cfg), poros, 2)
    assert result.ok, result.first_mismatch
    assert poros.counters()["capture_errors"] == 4


def test_a_kept_layer_whose_backward_capture_fails_runs_without_its_template_after(stores, monkeypatch):
    """A real replay of a captured forward refills its activations where its capture left them, unseen by
    autograd, while each call copies the layer's input into the template's own (a version each). An eager
    backward through the capture's autograd graph in a later step then meets its saved input at a newer
    version (on the H200: "modified by an inplace operation ... is at version 2; expected version 1"). Here
    the stand-in's forward replay does what a real one does from autograd's side (nothing), the backward's
    capture fails, and the gate must pass: the layer leaves its template after that backward."""
    from tests.engine.test_graphs import _FakeGraph, stand_in_graphs

    import poros.engine.runtime.templates as g

    stand_in_graphs(monkeypatch)
    real_replay, real_body = _FakeGraph.replay, g.KeptTemplate._body

    def replay(self):  # a kept forward: no new autograd graph, no version counted
        if isinstance(self.template, g.KeptTemplate) and self.template.phase == "forward":
            self.replays += 1
            return
        real_replay(self)

    def body(self):
        if self.phase == "backward" and "backward" not in self.graphs and self.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        real_body(self)

    def captured(self, what):  # the capture's body runs with `capturing` set, as under torch.cuda.graph
        self.capturing = True
        try:
            return real_captured(self, what)
        finally:
            self.capturing = False

    real_captured = g.LayerTemplate._captured
    monkeypatch.setattr(_FakeGraph, "replay", replay)
    monkeypatch.setattr(g.KeptTemplate, "_body", body)
    monkeypatch.setattr(g.KeptTemplate, "capturing", False, raising=False)
    monkeypatch.setattr(g.KeptTemplate, "_captured", captured)
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, lr=1e-2, keep_activations=True)
    poros = PorosTrainer(store, cfg, plan=_plan(store, cfg))
    poros.use_layer_templates(capture=True)
    with pytest.warns(UserWarning, match="capture failed, running the kept layer eagerly"):
        result = run_gate(ResidentTrainer(store, cfg), poros, 3)
    assert result.ok, result.first_mismatch
    kept = list(poros.templates.kept.values())
    assert kept and all(not t.usable and t.graphs["backward"] is None for t in kept)
    assert all(t.graphs["forward"].replays == 1 for t in kept)  # step 1 captured and replayed it, no later step
    assert poros.counters()["template_fallbacks"] == 2 * len(kept)  # steps 2 and 3


def test_a_budget_counts_the_kept_activations(stores):
    store = stores("tiny-qwen3")
    base = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, vram_budget="30MB")
    plain, kept = PorosTrainer(store, base).plan, PorosTrainer(store, base.replace(keep_activations=True)).plan
    assert plain.kept_layers == () and plain.memory.kept_activations == 0
    assert kept.kept_layers == tuple(kept.resident_layers) and kept.memory.kept_activations > 0
    assert kept.memory.total <= 30_000_000 and len(kept.resident_layers) <= len(plain.resident_layers)
    assert "activations kept" in P.describe(kept) and kept.summary()["kept_layers"] == list(kept.kept_layers)


def test_keeping_a_streamed_layers_activations_is_refused(stores):
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2)
    plan = replace(_plan(store, cfg), kept_layers=(0,))
    assert any("layer 0 keeps its activations but is streamed" in p for p in check(plan))
    with pytest.raises(CapabilityError, match="refusing an unsafe plan"):
        PorosTrainer(store, cfg, plan=plan)


def test_mixed_up_kept_activations_fail_the_gate(stores):
    """Negative control: each kept layer's backward runs from the other micro-batch's activations."""

    class Swapped(PorosTrainer):
        def _backward(self, op):
            kept = self.runners[op.layer].kept if op.layer in self.plan.kept_layers else {}
            a, b = (op.layer, 0), (op.layer, 1)
            if op.micro == 0 and a in kept and b in kept:
                kept[a], kept[b] = kept[b], kept[a]
            super()._backward(op)

    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, grad_accum=2, block_size=2, lr=1e-2, keep_activations=True)
    result = run_gate(ResidentTrainer(store, cfg), Swapped(store, cfg, plan=_plan(store, cfg)), 1)
    assert not result.ok


@pytest.mark.parametrize("templates", [False, True], ids=["eager", "templates"])
def test_some_resident_layers_keep_their_activations(stores, templates):
    """kept_layers: two of three resident layers keep their activations, the third recomputes; exact with
    and without layer templates, the recomputing resident layer in a shared template."""
    store = stores("tiny-gemma3")
    cfg = TrainConfig(model="tiny-gemma3", seq_len=64, grad_accum=2, block_size=2, lr=1e-2, keep_activations=True,
                      kept_layers=2)
    plan = build_plan(geometry_of_store(store, cfg), plan_request(cfg, resident_layers=3))
    assert plan.resident_layers == [2, 3, 4] and plan.kept_layers == (2, 3)
    poros = PorosTrainer(store, cfg, plan=plan)
    if templates:
        poros.use_layer_templates(capture=False)
    result = run_gate(ResidentTrainer(store, cfg), poros, 2)
    assert result.ok, result.first_mismatch
    if templates:
        assert sorted(poros.templates.kept) == [(i, m) for i in (2, 3) for m in (0, 1)]


def test_kept_layers_needs_keep_activations():
    with pytest.raises(ConfigError, match="kept_layers: .* needs keep_activations"):
        TrainConfig(model="tiny-qwen3", kept_layers=2)
    assert TrainConfig(model="tiny-qwen3", keep_activations=True, kept_layers="3").kept_layers == 3
