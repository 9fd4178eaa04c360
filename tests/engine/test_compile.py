"""Compiled decoder layers (`compile`) on the CPU (inductor's C++ backend): poros's bits are resident's
compiled bits; negative controls show the gate compares compiled with compiled, and that a compiled poros
layer must run its first forward through the training graph."""

from __future__ import annotations

import pytest
import torch

from poros.config import COMPUTED_NAMES, Method, TrainConfig
from poros.errors import ConfigError
from poros.engine.planning.search import build_plan
from poros.engine.runtime import runners
from poros.engine.methods.executor import PorosTrainer, geometry_of_store
from poros.engine.verify.parity import parity, run_gate
from poros.engine.methods.trainer import ResidentTrainer
from poros.settings import BY_NAME
from tests.plans import plan_request

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


pytestmark = pytest.mark.usefixtures("fresh_compile_caches")  # tests/engine/conftest.py


def compiled(model: str, **settings) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, compile=True, **{"block_size": 2, "lr": 1e-2, **settings})


def _ok(result) -> str:
    return f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


def test_compile_is_a_computed_setting_off_by_default():
    s = BY_NAME["compile"]
    assert "compile" in COMPUTED_NAMES and s.default is False and s.flag == "--compile"
    assert TrainConfig(model="tiny-qwen2").compile is False


def test_deterministic_compile_sets_inductor_deterministic(stores, monkeypatch):
    """Set by the trainer itself (newer torch also ties it to strict determinism, older does not: the
    strict mode is left out here so the trainer's own setting is what is seen)."""
    import torch._inductor.config as inductor

    from poros.engine.methods import trainer

    monkeypatch.setattr(trainer, "enable_determinism", lambda: None)
    # inductor's own patch, not monkeypatch: undoing a config attribute with delattr hides it from every
    # later compile in the process
    with inductor.patch(deterministic=False):
        ResidentTrainer(stores("tiny-qwen2"), TrainConfig(model="tiny-qwen2", seq_len=64, deterministic=True)).close()
        assert inductor.deterministic is False  # not without compile
        ResidentTrainer(stores("tiny-qwen2"), compiled("tiny-qwen2", deterministic=True)).close()
        assert inductor.deterministic is True


def test_compiled_poros_matches_compiled_resident(stores):
    result = parity(compiled("tiny-qwen2"), steps=2, store=stores("tiny-qwen2"))
    assert result.ok, _ok(result)
    assert result.steps == 2 and result.tensors_compared > 2 * 5 * 2 * 7


def test_inference_graph_forward_fails_the_gate(stores, monkeypatch):
    """Negative control: poros's first forward without autograd (inductor's inference graph, the eager
    runners' way) computes other bits than resident's compiled layers."""

    def inference_forward(self, key, x, call):
        with torch.no_grad():
            return runners.hidden_of(call(self.layers[key[0]], x))

    monkeypatch.setattr(runners.Recompute, "_forward", inference_forward)
    result = parity(compiled("tiny-qwen2"), steps=1, store=stores("tiny-qwen2"))
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss", _ok(result)


def test_compiled_resident_differs_from_eager_resident(stores):
    """Negative control: compiled layers compute other bits than eager ones, so a gate of a compiled run
    against an eager reference would fail; the gate compares runs that agree on `compile`."""
    store = stores("tiny-qwen2")
    eager = ResidentTrainer(store, compiled("tiny-qwen2").replace(compile=False))
    result = run_gate(eager, ResidentTrainer(store, compiled("tiny-qwen2")), 1)
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss", _ok(result)


@pytest.mark.slow
@pytest.mark.extended  # compiled tiny-qwen2 is gated above, tiny-gemma3 across schedules below and with kept attention
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_compiled_gate_per_family(stores, model):
    result = parity(compiled(model, grad_accum=2), steps=2, store=stores(model))
    assert result.ok, f"{model}: {_ok(result)}"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", pytest.param("tiny-gemma3", marks=pytest.mark.extended)],
                         ids=lambda m: f"model={m}")
def test_compiled_resident_gc_matches_compiled_resident(stores, model):
    """Resident with gradient checkpointing, compiled: checkpointed around each compiled layer, its forward and
    recompute run resident's compiled training graph, so it is a reference of the compiled setting too."""
    result = parity(compiled(model), steps=2, store=stores(model), method=Method.RESIDENT_GC)
    assert result.ok, f"{model}: {_ok(result)}"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [
    pytest.param(dict(overlap_backward=False), marks=pytest.mark.extended),
    dict(block_size=1, grad_accum=2, accumulation="micro"),
], ids=["serial", "block=1-micro"])
def test_compiled_gate_holds_across_schedules(stores, schedule):
    result = parity(compiled("tiny-gemma3", **schedule), steps=2, store=stores("tiny-gemma3"))
    assert result.ok, _ok(result)


@pytest.mark.slow
@pytest.mark.parametrize("templates", [False, True], ids=["eager", "templates"])
def test_compiled_kept_layers_match_compiled_resident(stores, templates):
    """Kept layers (resident's own forward with autograd, activations kept), compiled, with and without
    their templates."""
    store = stores("tiny-qwen3")
    cfg = compiled("tiny-qwen3", grad_accum=2, keep_activations=True)
    plan = build_plan(geometry_of_store(store, cfg), plan_request(
        cfg, block_size=2, resident_layers=2))
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg, plan=plan)
    if templates:
        poros.use_layer_templates(capture=False)
    result = run_gate(resident, poros, 2)
    assert result.ok, _ok(result)
    assert len(plan.kept_layers) == 2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen2", pytest.param("tiny-gemma3", marks=pytest.mark.extended)],
                         ids=lambda m: f"model={m}")
def test_compiled_layer_templates_match_compiled_resident(stores, model):
    """Layer templates (run eagerly here, as without capture) compile their own copy of the layer and run
    its forward through the training graph: the same bits."""
    store = stores(model)
    cfg = compiled(model, grad_accum=2)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    poros.use_layer_templates(capture=False)
    result = run_gate(resident, poros, 2)
    assert result.ok, f"{model}: {_ok(result)}"
    c = poros.counters()
    assert c["template_fallbacks"] == 0 and c["layer_templates"] > 0 and c["forward_templates"] > 0


def test_unsloth_runs_its_own_compilation_not_the_setting():
    """Unsloth, not gated, runs as its users run it (its own compiled kernels): `compile` is dropped from its
    settings, and kept for every gated method."""
    from poros.engine.methods.registry import config_for

    cfg = compiled("tiny-qwen2", deterministic=True)
    assert config_for(Method.UNSLOTH, cfg).compile is False
    assert all(config_for(m, cfg) is cfg for m in (Method.POROS, Method.RESIDENT, Method.RESIDENT_GC))
    eager_mlp = cfg.replace(compile_mlp=False)  # which needs compile, so Unsloth's settings take the default again
    assert config_for(Method.UNSLOTH, eager_mlp).compile_mlp is True


@pytest.mark.parametrize("settings, refused", [
    (dict(compile_mlp=False), "compile_mlp: off leaves each decoder layer's MLP out of its compiled graph, so it "
                              "needs compile"),
    (dict(compile=True, compile_mlp=False, device="cuda", cuda_graphs=True), "compile_mlp: off is for layers run "
                                                                            "without CUDA graphs"),
], ids=["without-compile", "with-cuda-graphs"])
def test_an_eager_mlp_outside_compiled_layers_is_refused(settings, refused):
    with pytest.raises(ConfigError, match=refused):
        TrainConfig(model="tiny-qwen2", **settings)
    TrainConfig(model="tiny-qwen2", compile=True, compile_mlp=False)  # the accepted neighbour


def _captures_compile(monkeypatch) -> list[int]:
    """The CUDA graph API replaced by the CPU stand-ins of tests/engine/test_graphs.py; returns the list of
    dynamo graphs compiled inside each capture (a real capture must record compiled kernels only)."""
    import poros.engine.runtime.graphs as g
    from torch._dynamo.utils import counters

    from tests.engine.test_graphs import _FakeCapture, stand_in_graphs

    stand_in_graphs(monkeypatch)
    compiled_inside: list[int] = []

    class Capture(_FakeCapture):
        def __enter__(self):
            self.before = counters["stats"]["unique_graphs"]
            return self

        def __exit__(self, *exc):
            compiled_inside.append(counters["stats"]["unique_graphs"] - self.before)
            return False

    monkeypatch.setattr(g.torch.cuda, "graph", Capture)
    return compiled_inside


@pytest.mark.slow
def test_compiled_templates_compile_before_their_capture(stores, monkeypatch):
    """The capture path with compiled layers (CPU stand-ins for the CUDA graph API): parity holds, every
    template is captured once, and nothing is compiled inside a capture (its warm-up call compiled it)."""
    compiled_inside = _captures_compile(monkeypatch)
    store = stores("tiny-qwen3")
    cfg = compiled("tiny-qwen3", grad_accum=2)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    poros.use_layer_templates(capture=True)
    result = run_gate(resident, poros, 2)
    assert result.ok, _ok(result)
    c = poros.counters()
    assert c["capture_errors"] == 0 and c["template_fallbacks"] == 0
    assert c["graphs_captured"] == len(poros.templates.templates) > 0
    assert compiled_inside and not any(compiled_inside), compiled_inside


@pytest.mark.slow
def test_without_warm_up_a_capture_would_compile(stores, monkeypatch):
    """Negative control of the check above: without the warm-up call, dynamo compiles inside the capture."""
    import poros.engine.runtime.graphs as g

    compiled_inside = _captures_compile(monkeypatch)
    monkeypatch.setattr(g, "COMPILED_WARMUP", 0)
    store = stores("tiny-qwen3")
    cfg = compiled("tiny-qwen3")
    poros = PorosTrainer(store, cfg)
    poros.use_layer_templates(capture=True)
    poros.step()
    assert any(compiled_inside), compiled_inside


def _kept_templates_gate(stores, monkeypatch, tmp_path):
    """Compiled kept layers' templates on the capture path (CPU stand-ins for the CUDA graph API, whose replays
    run the template's body again: a backward replay is a second backward over the capture's retained autograd
    graph), gated as the harness gates a plan: compiled resident first, recorded and closed, then poros. A fresh
    inductor cache, so the reference's compiled code is what the poros compile could be handed."""
    from poros.engine.verify.parity import RecordedReference, run_gate_recorded
    from tests.engine.test_graphs import stand_in_graphs

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    stand_in_graphs(monkeypatch)
    store = stores("tiny-qwen3")
    cfg = compiled("tiny-qwen3", deterministic=True, lora_compute="bf16", keep_activations=True)
    ref = ResidentTrainer(store, cfg)
    recorded = RecordedReference(ref, 2)
    ref.close()
    plan = build_plan(geometry_of_store(store, cfg), plan_request(
        cfg, block_size=2, resident_layers=len(store.layers)))
    poros = PorosTrainer(store, cfg, plan=plan)
    try:
        poros.use_layer_templates(capture=True)
        result = run_gate_recorded(recorded, poros)
        return result, poros.counters()
    finally:
        poros.close()


@pytest.mark.slow
@pytest.mark.extended  # with its negative control below: compiled kept templates on CPU stand-ins for CUDA graphs
def test_compiled_kept_templates_on_the_capture_path_match_compiled_resident(stores, monkeypatch, tmp_path):
    """A kept template runs its compiled backward more than once over one autograd graph: compiled backwards
    must leave their saved tensors as they are (poros/engine/model/compiling.py `backward_keeps_saved_tensors`)."""
    result, c = _kept_templates_gate(stores, monkeypatch, tmp_path)
    assert result.ok, _ok(result)
    assert c["kept_templates"] > 0 and c["graphs_captured"] == c["kept_templates"] and c["capture_errors"] == 0


@pytest.mark.slow
@pytest.mark.extended  # the negative control of the test above, beside it
def test_a_compiled_backward_that_donates_its_saved_tensors_fails_the_kept_templates_gate(stores, monkeypatch,
                                                                                           tmp_path):
    """Negative control: with AOTAutograd's donated buffers left on, a second backward over the retained graph
    reads what the first wrote into the saved tensors' memory."""
    import contextlib

    from poros.engine.methods import executor

    monkeypatch.setattr(executor, "backward_keeps_saved_tensors", contextlib.nullcontext)
    result, _ = _kept_templates_gate(stores, monkeypatch, tmp_path)
    assert not result.ok and result.first_mismatch.startswith("step0.grad:")


@pytest.mark.slow
def test_the_graph_cache_key_tells_kept_saved_tensors_from_donated_ones(stores, monkeypatch, tmp_path):
    """Negative control: inductor's graph cache alone does not tell a backward compiled to donate its saved
    tensors (the reference's, compiled first) from one compiled to keep them; with a pass uuid that does not
    say which, the kept templates are handed the reference's backward and fail."""
    from poros.engine.model.compiling import RecomputeDequantization

    monkeypatch.setattr(RecomputeDequantization, "uuid", lambda self: "poros-recompute-dequantization-control")
    result, _ = _kept_templates_gate(stores, monkeypatch, tmp_path)
    assert not result.ok and result.first_mismatch.startswith("step0.grad:")


def test_compiled_regenerations_are_the_forward_pass_bits(stores):
    """input_stride with compiled layers: the regenerating forward is the forward pass's (the training graph,
    its saved tensors dropped), so compiled poros still equals compiled resident; negative control: regenerating
    through the inference graph (no autograd, as an eager regeneration would) gives other bits and FAILs."""
    cfg = compiled("tiny-qwen2", input_stride=2)
    result = parity(cfg, steps=1, store=stores("tiny-qwen2"))
    assert result.ok, _ok(result)

    def inference_regenerate(self, key):
        with torch.no_grad():
            return runners.hidden_of(self.calls[key][0](self.layers[key[0]], self.saved.peek(key)[0]))

    with pytest.MonkeyPatch.context() as m:
        m.setattr(runners.Recompute, "regenerate", inference_regenerate)
        result = parity(cfg, steps=1, store=stores("tiny-qwen2"))
    assert result.parity == "FAIL", _ok(result)
