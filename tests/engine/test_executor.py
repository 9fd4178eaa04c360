"""The executor on CPU: runs any plan it is given bitwise equal to resident QLoRA, refuses unsafe
plans, and a plan that breaks a rule, run anyway, FAILs the gate."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poros.engine.planning.budget import make_plan
from poros.engine.planning.search import build_plan
from poros.choices import Placement
from poros.models.checkpoint import Source
from poros.store.build import build_store
from poros.config import TrainConfig
from poros.errors import CapabilityError
from poros.engine.methods.executor import PorosTrainer, geometry_of_store
from poros.engine.verify.parity import run_gate
from poros.models.shapes import get_shape
from poros.engine.methods.trainer import ResidentTrainer
from tests.faults import refill_before_backward, reverse_micro_batches_in_backward
from tests.plans import plan_request

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def gate(store, cfg, plan=None, check_plan=True, steps=2):
    resident = ResidentTrainer(store, cfg)
    poros = PorosTrainer(store, cfg, plan=plan, check_plan=check_plan)
    try:
        return run_gate(resident, poros, steps), poros.counters()
    finally:
        resident.close()
        poros.close()


def plan_for(store, cfg, **kw):
    geo = geometry_of_store(store, cfg)
    return build_plan(geo, plan_request(cfg, **kw))


PLAN_SPACE = dict(
    family=st.sampled_from(TINY), layers=st.integers(2, 6), block=st.integers(1, 4), accum=st.integers(1, 3),
    order=st.sampled_from(["layer", "micro"]), resident=st.integers(0, 6), head=st.sampled_from([None, True]),
    overlap=st.booleans(), seq=st.sampled_from([64, 96]), offload=st.booleans(), on_device=st.integers(0, 6),
    keep=st.booleans(),
    kept=st.sampled_from([None, 1]), placement=st.sampled_from(["tail", "spread"]), buffers=st.integers(2, 4))
HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=4, **HYPOTHESIS)
@given(**PLAN_SPACE)
def test_any_plan_keeps_parity(family, layers, block, accum, order, resident, head, overlap, seq, offload, on_device,
                               keep, kept, placement, buffers):
    """Hypothesis over families, depth, block size, accumulation and its order, resident layer count
    (0, some, all) and placement, the lm_head's place, saved inputs' place (how many layers' on the device), kept
    activations and the rotating buffers: every plan trains bitwise like resident QLoRA."""
    config = get_shape(family).config()
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = (config.layer_types * layers)[:layers]
    store, _ = build_store(Source(family, config), seed=layers, device="cpu", progress=False)
    cfg = TrainConfig(model=family, seq_len=seq, block_size=block, grad_accum=accum, accumulation=order, lr=1e-2,
                      overlap_backward=overlap, stream_buffers=buffers)
    plan = plan_for(store, cfg, resident_layers=min(resident, layers), head_resident=head, offload_inputs=offload,
                    keep_activations=keep, kept_layers=kept if keep else None, placement=Placement(placement),
                    device_inputs=on_device if offload else None)
    result, _ = gate(store, cfg, plan)
    assert result.ok, (f"{family} L={layers} K={block}x{buffers} G={accum}/{order} resident={resident}/{placement} "
                       f"head={head} overlap={overlap} offload={offload}/{on_device} keep={keep}/{kept}: "
                       f"{result.first_mismatch}")


@pytest.mark.slow  # each plan builds its own store and runs the gate
@settings(max_examples=10, **HYPOTHESIS)
@given(**PLAN_SPACE)
def test_many_plans_keep_parity(**plan):
    """The property of test_any_plan_keeps_parity over more plans."""
    test_any_plan_keeps_parity.hypothesis.inner_test(**plan)


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
@pytest.mark.parametrize("accum,keep", [(1, False), (3, True)], ids=["G=1", "G=3,kept"])
def test_spread_placement_keeps_parity(stores, model, accum, keep):
    """Streamed layers between resident ones (tiny models: 5 layers, 3 resident, streamed 0 and 2), the
    next streamed layer's copy enqueued across the resident layer between; with kept activations the
    resident layers are not contiguous either."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=accum, lr=1e-2, placement="spread")
    store = stores(model)
    plan = plan_for(store, cfg, resident_layers=3, keep_activations=keep, placement=Placement.SPREAD)
    assert plan.streamed_layers == [0, 2] and plan.resident_layers == [1, 3, 4]
    result, _ = gate(store, cfg, plan)
    assert result.ok, result.first_mismatch
    if accum > 1:  # negative control (G >= 3: two gradients sum alike in either order): micro-batches reversed FAIL
        broken, _ = gate(store, cfg, reverse_micro_batches_in_backward(plan), check_plan=False, steps=1)
        assert not broken.ok


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
@pytest.mark.parametrize("budget", ["4MB", "5MB", "1GB"], ids=lambda b: f"budget={b}")
def test_budgets_keep_parity_and_fit(stores, model, budget):
    """Budgets leaving none, some and all layers resident (the tiny models' smallest plan is ~4 MB)."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, lr=1e-2, vram_budget=budget)
    store = stores(model)
    try:
        trainer = PorosTrainer(store, cfg)
    except Exception as e:  # the smallest budget may be below a family's smallest plan: refused, named
        assert "below the smallest plan" in str(e)
        return
    assert trainer.plan.memory.total <= cfg.vram_budget
    trainer.close()
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch


def test_a_budget_that_holds_every_layer_keeps_their_activations_on_auto_and_keeps_parity(stores):
    """`keep_activations: auto` (CUDA's default beside a budget) where the budget holds every layer resident: the
    plan keeps their activations as far as the rest of the budget holds them, and the step is resident QLoRA's to
    the bit. Controls: the same budget with keep_activations off recomputes every layer; a budget holding some
    layers streamed keeps none (no layer streams for kept activations)."""
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, lr=1e-2, vram_budget="1GB", keep_activations="auto")

    def plan(c):  # the planning a trainer does, without building one
        p = make_plan(geometry_of_store(store, c), c)
        assert p.memory.total <= c.vram_budget
        return p

    every = plan(cfg)
    n = every.n_layers
    assert len(every.resident_layers) == n and tuple(every.kept_layers) == tuple(every.resident_layers)
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch
    some = plan(cfg.replace(vram_budget=every.memory.total - 1))  # one kept layer's memory short
    assert len(some.resident_layers) == n and 0 < len(some.kept_layers) < n
    result, _ = gate(store, cfg.replace(vram_budget=every.memory.total - 1))
    assert result.ok, result.first_mismatch
    off = plan(cfg.replace(keep_activations=False))
    assert len(off.resident_layers) == n and off.kept_layers == ()
    tight = plan(cfg.replace(vram_budget=off.memory.total - 1))  # not every layer resident: none kept
    assert tight.streamed_layers and tight.kept_layers == ()
    assert tight.resident_layers == plan(cfg.replace(vram_budget=off.memory.total - 1,
                                                     keep_activations=False)).resident_layers


@pytest.mark.parametrize("accum", [2, 3, 8], ids=lambda g: f"accum={g}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_layer_major_accumulation_is_exact(stores, model, accum):
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=accum, lr=1e-2)
    result, _ = gate(stores(model), cfg, steps=1)
    assert result.ok, result.first_mismatch


def test_layer_major_accumulation_copies_each_block_once_per_step(stores):
    store = stores("tiny-gemma3")
    copied = {}
    for g in (1, 3):
        trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2, grad_accum=g))
        copied[g] = [trainer.step().counters["bytes_h2d"] for _ in range(2)]
        trainer.close()
    assert copied[3] == copied[1], "layer-major copies each block once per step, whatever grad_accum"


def test_reversed_micro_batch_order_fails_the_gate(stores):
    """Negative control for layer-major accumulation: the same micro-batches, backpropagated per layer in
    reverse order, sum every LoRA gradient in another order; the gate must see it."""
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, grad_accum=8, lr=1e-2)
    store = stores("tiny-qwen3")
    bad = reverse_micro_batches_in_backward(plan_for(store, cfg))
    with pytest.raises(CapabilityError, match="another order"):
        PorosTrainer(store, cfg, plan=bad)
    result, _ = gate(store, cfg, plan=bad, check_plan=False)
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_refill_before_backward_is_refused_and_fails_the_gate_when_run(stores):
    """Negative control for the bitsandbytes trap: the forward stays exact, gradients go wrong."""
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2)
    store = stores("tiny-qwen3")
    bad = refill_before_backward(plan_for(store, cfg))
    with pytest.raises(CapabilityError, match="refusing an unsafe plan"):
        PorosTrainer(store, cfg, plan=bad)
    result, _ = gate(store, cfg, plan=bad, check_plan=False)
    assert result.parity == "FAIL" and result.first_mismatch.startswith("step0.grad:"), result.first_mismatch
    assert result.losses  # the loss of step 0 was still equal


@pytest.mark.parametrize("block", [1, 2, 5], ids=lambda k: f"block={k}")
def test_counters_match_the_plan(stores, block):
    store = stores("tiny-gemma3")
    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=block))
    for _ in range(3):
        c = trainer.step().counters
        assert c["bytes_h2d"] == trainer.plan.h2d_bytes_per_step
        assert c["block_copies"] == trainer.plan.loads_per_step
    trainer.close()


def test_weight_buffers_are_allocated_once_and_every_linear_reads_one(stores):
    store = stores("tiny-gemma3")
    trainer = PorosTrainer(store, TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2))
    ptrs = {k: v.data_ptr() for k, v in trainer.buffers.views.items()}
    trainer.step()
    trainer.step()
    assert {k: v.data_ptr() for k, v in trainer.buffers.views.items()} == ptrs
    spans = [(v.data_ptr(), v.data_ptr() + v.numel()) for v in trainer.buffers.views.values()]
    for q in trainer.qlora.linear4bit.values():
        assert any(lo <= q.weight.data_ptr() < hi for lo, hi in spans)
    trainer.close()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_layer_backward_runs_where_the_schedule_says(stores, overlap):
    """With `overlap_backward` every layer's backward runs on the worker thread (so the next layer's
    recompute can be enqueued meanwhile); without it, on the calling thread."""
    trainer = PorosTrainer(stores("tiny-gemma3"), TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2,
                                                                overlap_backward=overlap))
    seen: dict[int, set[str]] = {}
    for i, layer in enumerate(trainer.qlora.layers):
        p = next(p for n, p in layer.named_parameters() if "lora_A" in n)
        p.register_hook(lambda g, i=i: seen.setdefault(i, set()).add(threading.current_thread().name))
    trainer.step()
    assert sorted(seen) == list(range(len(trainer.qlora.layers)))
    names = set().union(*seen.values())
    if overlap:
        assert all(n.startswith("poros-backward") for n in names), names
    else:
        assert names == {threading.current_thread().name}
    trainer.close()
    assert trainer._worker is None


def test_an_error_in_a_worker_backward_reaches_the_caller(stores, monkeypatch):
    import poros.engine.methods.executor as ex

    trainer = PorosTrainer(stores("tiny-gemma3"), TrainConfig(model="tiny-gemma3", seq_len=64, block_size=2))
    real = ex.torch.autograd.backward

    def backward(tensors, grad_tensors=None, *a, **k):
        if threading.current_thread().name.startswith("poros-backward"):
            raise RuntimeError("injected backward failure")
        return real(tensors, grad_tensors, *a, **k)

    monkeypatch.setattr(ex.torch.autograd, "backward", backward)
    with pytest.raises(RuntimeError, match="injected backward failure"):
        trainer.step()
    trainer.close()


def test_a_plan_for_other_micro_batches_is_refused(stores):
    trainer = PorosTrainer(stores("tiny-qwen2"), TrainConfig(model="tiny-qwen2", seq_len=64, grad_accum=2))
    with pytest.raises(CapabilityError, match="plan is for 2 micro-batches"):
        trainer.accumulate(trainer.batches(0)[:1])
    trainer.close()


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_saved_inputs_in_host_memory_keep_parity_and_move_every_input_both_ways(stores, model):
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, offload_inputs=True)
    store = stores(model)
    result, _ = gate(store, cfg)
    assert result.ok, result.first_mismatch
    trainer = PorosTrainer(store, cfg)
    c = trainer.step().counters
    per_input = 64 * store.config.hidden_size * 2
    assert c["input_bytes_d2h"] == c["input_bytes_h2d"] == len(store.layers) * 2 * per_input
    assert trainer.plan.d2h_bytes_per_step == c["input_bytes_d2h"]
    assert c["bytes_h2d"] == trainer.plan.h2d_bytes_per_step
    trainer.close()


def test_corrupted_saved_inputs_fail_the_gate(stores, monkeypatch):
    """Negative control: an input that comes back from host memory with one value changed must FAIL."""
    import poros.engine.methods.executor as ex

    real = ex.SavedInputs.take

    def take(self, key):
        x, *rest = real(self, key)
        if key == (2, 0):
            x = x.clone()
            x.view(-1)[5] += 1
        return (x, *rest)

    monkeypatch.setattr(ex.SavedInputs, "take", take)
    cfg = TrainConfig(model="tiny-qwen2", seq_len=64, block_size=2, lr=1e-2, offload_inputs=True)
    result, _ = gate(stores("tiny-qwen2"), cfg)
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


@pytest.mark.parametrize("model,plain", [("tiny-qwen3", True), ("tiny-gemma3", False)])
def test_the_host_embedding_lookup_gives_the_modules_own_bytes(stores, monkeypatch, model, plain):
    """A plain nn.Embedding is looked up with index_select (the same rows, without F.embedding's slow host
    path); a model's own embedding (gemma's scaled one) keeps its forward. Either way, its bytes."""
    import torch

    trainer = PorosTrainer(stores(model), TrainConfig(model=model, seq_len=64))
    emb = trainer.qlora.hf.get_input_embeddings()
    ids = torch.randint(0, emb.num_embeddings, (2, 64))
    expected = type(emb).forward(emb, ids)
    calls = []
    real = torch.nn.functional.embedding
    monkeypatch.setattr(torch.nn.functional, "embedding", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = emb(ids)
    trainer.close()
    assert torch.equal(got, expected) and got.dtype == expected.dtype
    assert (not calls) == plain
    bad = ids.clone()
    bad[0, 0] = (bad[0, 0] + 1) % emb.num_embeddings
    assert not torch.equal(type(emb).forward(emb, bad), got)  # negative control: another token, other bytes


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_the_host_lookup_reads_the_batch_s_host_ids(stores, model):
    """A batch moved to a CUDA device keeps the host's token ids (`Batch.host_input_ids`), and the embedding's host
    lookup reads those rather than copying the device's back (a copy that waits for every kernel queued before it).
    Here the ids handed to the model differ from the batch's host ids: the lookup follows the host ids while a pass
    carries them, the ids it was handed otherwise, or where the shapes differ."""
    import torch

    from poros.engine.methods.data import Batch

    trainer = PorosTrainer(stores(model), TrainConfig(model=model, seq_len=64))
    emb = trainer.qlora.hf.get_input_embeddings()
    host, handed = (torch.randint(0, emb.num_embeddings, (1, 64), generator=torch.Generator().manual_seed(s))
                    for s in (1, 2))
    own = type(emb).forward
    trainer._host_ids = host
    assert torch.equal(emb(handed), own(emb, host))
    assert torch.equal(emb(handed[:, :32]), own(emb, handed[:, :32]))  # another shape: not this batch's ids
    trainer._host_ids = None  # control: without them the handed ids are looked up
    assert torch.equal(emb(handed), own(emb, handed)) and not torch.equal(own(emb, handed), own(emb, host))
    trainer.close()
    on_cpu = Batch(host, host.clone()).to("cpu")
    assert on_cpu.host_input_ids is None and torch.equal(on_cpu.input_ids, host)


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma3"], ids=lambda m: f"model={m}")
@pytest.mark.parametrize("buffers,accum,head,layers,head_buffer", [
    (3, 1, None, 5, 0), (4, 3, None, 5, 3), (3, 1, None, 6, 1), (3, 2, True, 5, None)],
    ids=["K=3", "K=4,G=3", "K=3,lm_head in the middle buffer", "K=3,G=2,lm_head resident"])
def test_more_stream_buffers_keep_parity(stores, model, buffers, accum, head, layers, head_buffer):
    """Blocks of one layer streamed through 3 and 4 rotating buffers (prefetches 2 and 3 groups ahead; the lm_head in
    the buffer of the group before the last: the first, the last or one between, its pad beside it; or resident):
    bitwise resident QLoRA. The buffers and the lm_head's region never overlap one another's bytes; the negative
    control refills a buffer before the backward that reads it: refused, and run anyway it FAILs."""
    cfg = TrainConfig(model=model, seq_len=64, block_size=1, grad_accum=accum, lr=1e-2, stream_buffers=buffers)
    if layers == 5:
        store = stores(model)
    else:
        config = get_shape(model).config()
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = (config.layer_types * layers)[:layers]
        store, _ = build_store(Source(model, config), seed=layers, device="cpu", progress=False)
    plan = plan_for(store, cfg, head_resident=head)
    assert plan.n_layers == layers and plan.head_buffer == head_buffer
    assert sum(not b.resident for b in plan.buffers) == buffers
    trainer = PorosTrainer(store, cfg, plan=plan)
    b = trainer.buffers
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel(), k) for k, v in b.views.items())
    assert all(hi <= lo for (_, hi, _), (lo, _, _) in zip(spans, spans[1:])), spans
    if plan.head_buffer is not None:
        head_lo = b.head_region.data_ptr()
        head_hi = head_lo + b.head_region.numel()
        for lo, hi, k in spans:
            assert k == plan.head_buffer or hi <= head_lo or lo >= head_hi, f"the lm_head overlaps buffer {k}"
    trainer.close()
    result, _ = gate(store, cfg, plan)
    assert result.ok, result.first_mismatch
    if accum == 1:
        bad = refill_before_backward(plan)
        with pytest.raises(CapabilityError, match="refusing an unsafe plan"):
            PorosTrainer(store, cfg, plan=bad)
        broken, _ = gate(store, cfg, plan=bad, check_plan=False, steps=1)
        assert broken.parity == "FAIL", "a buffer refilled before its backward must fail the gate"


class _HostReads:
    """Counts the reads of a tensor's value on the host during a step (on a CUDA device each one waits for every
    kernel queued before it), with where transformers made them."""

    READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::item")

    def __init__(self):
        self.sites = []

    def __enter__(self):
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        sites = self.sites

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func._schema.name in _HostReads.READS:
                    sites.append([f.name for f in traceback.extract_stack() if "transformers" in f.filename])
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_a_step_s_passes_read_no_device_value_on_the_host(stores, model, monkeypatch):
    """Transformers checks the positions it derives for packed sequences by reading a device tensor on the host, in
    every pass (the prologue and the head, each mask of gemma3's): a wait for every queued kernel. The passes take
    the answer it gives for their positions (None: one range per row) without the read, and a step reads no value
    on the host at all; gate parity holds (the gate tests). Negative control: where the check is left as it is, the
    step reads, in transformers' packed-sequence check."""
    from poros.engine.runtime import model_hooks

    trainer = PorosTrainer(stores(model), TrainConfig(model=model, seq_len=64, block_size=2))
    trainer.step()
    with _HostReads() as reads:
        trainer.step()
    assert reads.sites == []
    monkeypatch.setattr(model_hooks, "_packing_check", lambda: None)
    with _HostReads() as reads:
        trainer.step()
    trainer.close()
    assert len(reads.sites) >= 2 and all("find_packed_sequence_indices" in s for s in reads.sites), reads.sites


def test_a_packing_check_that_answers_a_mask_for_a_range_is_left_as_it_is(monkeypatch):
    """Where the installed transformers' check answers a mask tensor even for one range per row (its masks then
    differ from those of None), the passes do not replace it; the check this transformers has answers None."""
    import torch
    from transformers import masking_utils

    from poros.engine.runtime import model_hooks

    model_hooks._packing_check.cache_clear()
    assert model_hooks._packing_check() is masking_utils  # the installed one answers None for a range
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda position_ids: torch.zeros_like(position_ids))
    model_hooks._packing_check.cache_clear()
    try:
        assert model_hooks._packing_check() is None
        with model_hooks._positions_unpacked():
            assert masking_utils.find_packed_sequence_indices(torch.arange(3)[None]) is not None
    finally:
        model_hooks._packing_check.cache_clear()
