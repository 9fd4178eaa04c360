"""Layer templates (poros/engine/runtime/graphs.py) on CPU, run eagerly: the copies in and out that let layers
share one template (one CUDA graph on the GPU) must keep bitwise parity; corrupting them must not."""

from __future__ import annotations

import pytest

from poros.store.build import build_store
from poros.config import TrainConfig
from poros.errors import ConfigError
from poros.engine.runtime.graphs import LayerTemplate, copy_groups, layer_key
from poros.engine.verify.parity import run_gate
from poros.engine.methods.executor import PorosTrainer
from poros.engine.methods.trainer import ResidentTrainer

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def _gate(store, cfg, steps=2, mutate=None):
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    poros.use_layer_templates(capture=False)
    if mutate:
        mutate(poros)
    return run_gate(resident, poros, steps), poros


@pytest.mark.parametrize("grad_accum", [1, 2], ids=lambda g: f"accum={g}")
@pytest.mark.parametrize("block", [1, 2], ids=lambda k: f"block={k}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_templates_keep_parity(stores, model, block, grad_accum):
    store = stores(model)
    cfg = TrainConfig(model=model, seq_len=64, block_size=block, grad_accum=grad_accum, lr=1e-2)
    result, poros = _gate(store, cfg)
    assert result.ok, f"first mismatch {result.first_mismatch} ({result.max_abs_diff:.3e})"
    c = poros.counters()
    n = len(store.layers)
    assert c["template_fallbacks"] == 0
    # every layer went through a template, forward and backward, per micro-batch over 2 steps
    for backward in (True, False):
        replays = sum(t.replays for k, t in poros.templates.templates.items() if k[0] is backward)
        assert replays == n * 2 * grad_accum
    # layers at the same buffer position share one: at most 2 buffers x block positions x layer kinds
    kinds = len({(k[0],) + k[2:] for k in map(layer_key, poros.qlora.layers)})  # the key less the addresses
    for name in ("layer_templates", "forward_templates"):
        assert c[name] <= 2 * block * kinds
        if kinds == 1 and n > 2 * block:  # uniform layers (qwen): fewer templates than layers
            assert c[name] < n


def test_layers_share_a_key_only_at_the_same_buffer_position(stores):
    store = stores("tiny-qwen2")  # 5 uniform layers
    poros = PorosTrainer(store, TrainConfig(model="tiny-qwen2", seq_len=64, block_size=1))
    keys = [layer_key(layer) for layer in poros.qlora.layers]
    # block size 1: layer i lives in buffer i % 2
    assert keys[0] == keys[2] == keys[4] and keys[1] == keys[3]
    assert keys[0] != keys[1]


def test_a_template_that_keeps_another_layers_lora_fails_the_gate(stores):
    """Negative control: without copying each layer's own LoRA weights in, the template computes
    with the first layer's; the gate must FAIL (on the gradients: at step 0 every LoRA B is zero, so
    the forward cannot tell yet)."""
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=1, lr=1e-2)
    original = LayerTemplate._load

    def load_without_lora(self, layer, x, tensors, grad):
        saved = [p.detach().clone() for p in self.lora]
        original(self, layer, x, tensors, grad)
        for p, s in zip(self.lora, saved):
            p.data.copy_(s)

    def mutate(poros):
        LayerTemplate._load = load_without_lora

    try:
        result, _ = _gate(store, cfg, steps=2, mutate=mutate)
    finally:
        LayerTemplate._load = original
    assert result.parity == "FAIL"
    assert ".grad:" in result.first_mismatch or ".weight:" in result.first_mismatch, result.first_mismatch


def test_a_template_s_tensors_are_copied_in_one_group_per_dtype(stores):
    """torch's foreach copy takes its one-launch path only over tensors of one dtype: a template copies its
    tensors in (LoRA weights, norms, the input, the call's arguments) as one group per dtype, every tensor in
    exactly one. Negative control: a template that skips a group (here its bf16 one: the input, the activations
    and the norms) computes on stale tensors and the gate FAILs."""
    import torch

    t = [torch.zeros(2, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float32, torch.int64, torch.bfloat16)]
    assert copy_groups(t) == [[0, 2], [1, 4], [3]]
    assert copy_groups([]) == []
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=1, lr=1e-2)
    result, poros = _gate(store, cfg)
    assert result.ok
    some = next(iter(poros.templates.templates.values()))
    kinds = [{some._dst[i].dtype for i in g} for g in some._groups]
    assert all(len(k) == 1 for k in kinds) and sorted(i for g in some._groups for i in g) == list(range(len(some._dst)))
    original = LayerTemplate._load

    def load_skipping_bf16(self, layer, x, tensors, grad):
        original(self, layer, x, tensors, grad)
        kept = [k for k, g in enumerate(self._groups) if self._dst[g[0]].dtype != torch.bfloat16]
        if kept:
            self._groups, self._dst_groups = [self._groups[k] for k in kept], [self._dst_groups[k] for k in kept]

    try:
        LayerTemplate._load = load_skipping_bf16
        failed, _ = _gate(store, cfg)
    finally:
        LayerTemplate._load = original
    assert failed.parity == "FAIL"


def test_cuda_graphs_is_declared_cuda_only():
    with pytest.raises(ConfigError, match="cuda_graphs: needs device cuda"):
        TrainConfig(model="tiny-qwen3", cuda_graphs=True)


def test_models_whose_layers_reuse_other_layers_kv_are_refused():
    """gemma4 can share K/V across layers (num_kv_shared_layers): layer-by-layer recompute would
    drop that gradient path, so poros refuses such a model up front instead of training it wrong."""
    from poros.models.checkpoint import Source
    from poros.errors import CapabilityError
    from poros.models.shapes import get_shape

    config = get_shape("tiny-gemma4").config()
    config.num_kv_shared_layers = 2
    try:
        store, _ = build_store(Source("tiny-gemma4", config), seed=0, device="cpu", progress=False)
    except Exception as e:  # transformers may reject the edited config itself: then nothing to gate
        pytest.skip(f"config not buildable with KV sharing here: {e}")
    with pytest.raises(CapabilityError, match="num_kv_shared_layers=2"):
        PorosTrainer(store, TrainConfig(model="tiny-gemma4", seq_len=64, block_size=1))


def test_a_template_that_cannot_be_captured_falls_back_to_eager_and_says_so(stores, monkeypatch):
    """Capture is CUDA-only; here it is made to fail: every layer then runs eagerly, parity holds,
    and the counters report the failures (the sweep prints their messages)."""
    import poros.engine.runtime.graphs as g

    monkeypatch.setattr(g.torch.cuda, "graph_pool_handle", lambda: None)

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(g.LayerTemplate, "_capture", fail)
    store = stores("tiny-qwen2")
    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=1, lr=1e-2)
    resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
    poros.use_layer_templates(capture=True)
    with pytest.warns(UserWarning, match="capture failed"):
        result = run_gate(resident, poros, 2)
    assert result.ok, result.first_mismatch
    c = poros.counters()
    assert c["graphs_captured"] == 0 and c["capture_errors"] == c["layer_templates"] + c["forward_templates"] > 0
    assert poros.templates.errors() == ["RuntimeError: operation not permitted when stream is capturing"]


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: 'replay' re-runs the template's body, as a real
    replay recomputes into the same static tensors (grads are overwritten, not accumulated)."""

    def __init__(self):
        self.template = None
        self.replays = 0

    def replay(self):
        self.template._clear_grads()
        self.template._body()
        self.replays += 1


class _FakeCapture:
    """torch.cuda.graph(graph, pool=...) on CPU: runs the body once (a real capture records it) and
    ties the graph to the template that is capturing."""

    def __init__(self, graph, pool=None):
        import inspect

        self.graph = graph
        self.graph.template = inspect.currentframe().f_back.f_locals["self"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stand_in_graphs(monkeypatch) -> None:
    """The CUDA graph API replaced by the CPU stand-ins above."""
    import contextlib

    import poros.engine.runtime.graphs as g

    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(g.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(g.torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(g.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(g.torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(g.torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(g.torch.cuda, "graph", _FakeCapture)


def test_the_capture_path_keeps_parity_with_stand_in_graphs(stores, monkeypatch):
    """The capture-mode control flow (capture once per template, replay, outputs read from the
    template's static tensors, no clearing between replays) run on CPU with stand-ins for the CUDA
    graph API: parity must hold and every template must be captured exactly once."""
    stand_in_graphs(monkeypatch)
    for model in ("tiny-qwen3", "tiny-gemma3"):
        store = stores(model)
        cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2)
        resident, poros = ResidentTrainer(store, cfg), PorosTrainer(store, cfg)
        poros.use_layer_templates(capture=True)
        result = run_gate(resident, poros, 2)
        assert result.ok, f"{model}: {result.first_mismatch}"
        c = poros.counters()
        assert c["capture_errors"] == 0 and c["template_fallbacks"] == 0
        templates = poros.templates.templates.values()
        assert c["graphs_captured"] == len(templates) > 0
        n = len(store.layers)
        assert sum(t.graph.replays for t in templates) == 2 * n * 2 * 2  # fwd+bwd, layers, micro-batches, steps


def test_every_capture_warms_up_on_one_side_stream(stores, monkeypatch):
    """What a warm-up frees stays cached for its stream alone: every template of a trainer runs its calls before
    capture on the one side stream its shared tensors hold, so each warm-up reuses the last one's memory. Control:
    templates of another set of shared tensors (another trainer) warm up on another stream."""
    import contextlib
    from types import SimpleNamespace

    import poros.engine.runtime.graphs as g

    stand_in_graphs(monkeypatch)
    made, used = [], []

    class _Stream:
        def __init__(self):
            made.append(self)

        def wait_stream(self, other):
            pass

    def on(stream):
        used.append(stream)
        return contextlib.nullcontext()

    monkeypatch.setattr(g.torch.cuda, "Stream", _Stream)
    main = SimpleNamespace(wait_stream=lambda other: None)
    monkeypatch.setattr(g.torch.cuda, "current_stream", lambda *a: main)
    monkeypatch.setattr(g.torch.cuda, "stream", on)
    monkeypatch.setattr(g, "graph_warmup", lambda: 1)  # a warm-up call before each capture
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2)
    streams = []
    for _ in range(2):
        poros = PorosTrainer(store, cfg)
        poros.use_layer_templates(capture=True)
        poros.step()
        templates = poros.templates.templates.values()
        assert len(templates) > 1 and all(t.captured for t in templates)
        streams.append(set(map(id, used)))
        used.clear()
    assert len(streams[0]) == len(streams[1]) == 1 and streams[0] != streams[1] and len(made) == 2


def test_templates_share_one_set_of_static_tensors(stores):
    """Every template of one shape reads and writes the same static memory (a leaf of its own over it):
    what a template keeps does not grow with the number of templates."""
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, grad_accum=2, lr=1e-2)
    result, poros = _gate(store, cfg)
    assert result.ok, result.first_mismatch
    templates = list(poros.templates.templates.values())
    backward = [t for t in templates if t.backward]
    assert len(backward) > 1
    assert len({id(t.static_x) for t in backward}) == len(backward)  # each its own leaf
    assert len({t.static_x.data_ptr() for t in templates}) == 1  # over one input's memory
    assert len({t.static_dx.data_ptr() for t in backward}) == 1
    hidden = 64 * store.config.hidden_size * 2  # one bf16 activation of seq 64
    statics = poros.templates.statics
    roles = {k[0] for k in statics.tensors}
    assert {"input", "grad_output", "grad_input", "output"} <= roles
    assert 4 * hidden <= statics.nbytes < 4 * hidden + 4 * 64 * 64 * 4 * 8  # + the rotary/mask arguments
    assert poros.counters()["template_static_bytes"] == statics.nbytes


def test_a_template_that_does_not_copy_its_result_out_fails_the_gate(stores, monkeypatch):
    """Negative control for the shared statics: a template whose result stays where the next template
    overwrites it (nothing copied out) must FAIL."""
    from poros.engine.runtime.graphs import LayerTemplate

    monkeypatch.setattr(LayerTemplate, "_put", lambda self, dst, src: None)
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, lr=1e-2)
    result, _ = _gate(store, cfg, steps=1)
    assert not result.ok
