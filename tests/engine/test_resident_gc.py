"""Resident QLoRA with gradient checkpointing (`resident_gc`): it checkpoints every decoder layer, it is
bitwise equal to plain resident QLoRA, and poros is bitwise equal to it, so it can be the gate's
reference where plain resident does not fit; a matrix without resident gets that gate. `resident_gc_offload`
keeps every checkpointed layer's input in host memory, with resident_gc's bits: the reference where even
resident_gc does not fit."""

from __future__ import annotations

import pytest

from poros.config import Method, TrainConfig
from poros.engine.methods.registry import gate_of, gated, make_trainer
from poros.engine.verify.parity import run_gate

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]


def _cfg(model: str, **kw) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, **kw)


def _layer_runs(trainer) -> list[int]:
    """Counts each decoder layer's MLP forwards (a pre-hook: a checkpoint's recompute may stop inside it)."""
    runs = [0] * len(trainer.qlora.layers)
    for i, layer in enumerate(trainer.qlora.layers):
        layer.mlp.register_forward_pre_hook(lambda module, args, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_every_layer_is_recomputed_in_backward(stores, model):
    """resident_gc runs each layer's forward twice per micro-batch (forward, recompute); plain resident once."""
    cfg = _cfg(model)
    gc, plain = (make_trainer(m, stores(model), cfg) for m in (Method.RESIDENT_GC, Method.RESIDENT))
    n = len(gc.qlora.layers)
    assert sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in gc.qlora.layers) == n
    runs = {name: _layer_runs(t) for name, t in (("gc", gc), ("plain", plain))}
    gc.step()
    plain.step()
    assert runs["gc"] == [2 * cfg.grad_accum] * n, runs
    assert runs["plain"] == [cfg.grad_accum] * n, runs
    gc.close()
    plain.close()


@pytest.mark.parametrize("reference,method", [
    (Method.RESIDENT, Method.RESIDENT_GC), (Method.RESIDENT_GC, Method.POROS),
    (Method.RESIDENT_GC, Method.RESIDENT_GC_OFFLOAD), (Method.RESIDENT_GC_OFFLOAD, Method.POROS)],
    ids=["resident_gc=resident", "poros=resident_gc", "resident_gc_offload=resident_gc", "poros=resident_gc_offload"])
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_gated_bitwise(stores, model, reference, method):
    """resident_gc is bitwise resident QLoRA, and poros is bitwise resident_gc (the long-context gate); so is
    resident_gc with its layers' inputs in host memory."""
    cfg = _cfg(model)
    result = run_gate(make_trainer(reference, stores(model), cfg), make_trainer(method, stores(model), cfg), steps=2)
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    assert (result.gate, result.method) == (reference.value, method.value)
    assert result.steps == 2 and result.tensors_compared > 2 * (2 + 5 * 2 * 7 * 2)


def test_resident_gc_with_another_lr_fails(stores):
    """Negative control: the gate sees resident_gc computing something else."""
    cfg = _cfg("tiny-qwen3")
    result = run_gate(make_trainer(Method.RESIDENT, stores("tiny-qwen3"), cfg),
                      make_trainer(Method.RESIDENT_GC, stores("tiny-qwen3"), cfg.replace(lr=2e-2)), steps=2)
    assert result.parity == "FAIL" and result.first_mismatch.startswith("step0.weight:"), result.first_mismatch


@pytest.mark.parametrize("sequential", [False, True], ids=lambda s: f"sequential={s}")
def test_parity_against_resident_gc(stores, sequential):
    """`parity(reference=resident_gc)`: side by side, or the reference first, recorded in host memory."""
    from poros.engine.verify.parity import parity

    result = parity(_cfg("tiny-gemma3"), steps=2, store=stores("tiny-gemma3"), reference=Method.RESIDENT_GC,
                    sequential=sequential)
    assert result.ok, f"first mismatch {result.first_mismatch}"
    assert result.gate == ("resident_gc (recorded)" if sequential else "resident_gc") and result.method == "poros"


def test_sequential_parity_fails_for_other_arithmetic(stores, monkeypatch):
    """Negative control for the recorded gate: poros with a different lr than its reference FAILs."""
    import poros.engine.methods.registry
    import poros.engine.verify.parity
    from poros.engine.verify.parity import parity

    real = poros.engine.methods.registry.make_trainer

    def other_lr(method, store, cfg, world=None):
        return real(method, store, cfg.replace(lr=2e-2) if method is Method.POROS else cfg, world)

    monkeypatch.setattr(poros.engine.verify.parity, "make_trainer", other_lr)
    result = parity(_cfg("tiny-qwen3"), steps=2, store=stores("tiny-qwen3"), reference=Method.RESIDENT_GC,
                    sequential=True)
    assert result.parity == "FAIL" and result.first_mismatch.startswith("step0.weight:"), result.first_mismatch


def test_resident_gc_offload_keeps_every_layer_input_in_host_memory(stores):
    """Each step packs every checkpointed layer's input (and what the head saves) into host memory and
    unpacks as many bytes."""
    cfg = _cfg("tiny-qwen3")
    trainer = make_trainer(Method.RESIDENT_GC_OFFLOAD, stores("tiny-qwen3"), cfg)
    try:
        c = trainer.step().counters
    finally:
        trainer.close()
    n, hidden = len(stores("tiny-qwen3").layers), stores("tiny-qwen3").config.hidden_size
    assert c["saved_bytes_d2h"] == c["saved_bytes_h2d"] >= n * cfg.grad_accum * 64 * hidden * 2


def test_resident_gc_offload_recomputes_from_the_bytes_in_host_memory(stores, monkeypatch):
    """Negative control: one value of one layer input changed on its way back from host memory FAILs the gate
    against resident_gc (the recompute reads the host copy, not the device's)."""
    from poros.engine.runtime.host_saved import HostSaved

    real, hidden, changed = HostSaved.unpack, stores("tiny-qwen3").config.hidden_size, []

    def unpack(self, packed):
        t = real(self, packed)
        if not changed and isinstance(packed, tuple) and t.dim() == 3 and t.shape[-1] == hidden:
            changed.append(t.shape)
            t = t.clone()
            t.view(-1)[7] += 1
        return t

    cfg = _cfg("tiny-qwen3")
    monkeypatch.setattr(HostSaved, "unpack", unpack)
    result = run_gate(make_trainer(Method.RESIDENT_GC, stores("tiny-qwen3"), cfg),
                      make_trainer(Method.RESIDENT_GC_OFFLOAD, stores("tiny-qwen3"), cfg), steps=1)
    assert changed and result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_host_saved_moves_activations_and_leaves_weights():
    """A linear saves its input and its weight: the input goes to host memory and comes back with its bytes, the
    weight stays (negative control: without the model named, the weight moves too)."""
    import torch

    from poros.engine.runtime.host_saved import HostSaved

    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    lin(x * 2).sum().backward()
    want = x.grad, lin.weight.grad
    for model, moved in ((lin, 3 * 8 * 4), (torch.nn.Module(), 3 * 8 * 4 + 4 * 8 * 4)):
        x.grad = lin.weight.grad = lin.bias.grad = None
        saved = HostSaved(pin=False)
        with saved.scope(model):
            y = lin(x * 2)
        y.sum().backward()
        assert saved.counters() == {"saved_bytes_d2h": moved, "saved_bytes_h2d": moved, "saved_bytes_kept": 0}
        assert torch.equal(x.grad, want[0]) and torch.equal(lin.weight.grad, want[1])


def test_host_saved_past_its_limit_keeps_the_later_tensors_on_the_device():
    """With `host_limit`, the first tensors a forward saves go to host memory while their blocks fit and the rest
    stay where they are, with the same gradients; each scope starts counting again (the control: no limit moves
    every one)."""
    import torch

    from poros.engine.runtime.host_saved import HostSaved, host_block

    a, b = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 4, bias=False)
    model = torch.nn.Sequential(a, b)
    x = torch.randn(3, 8, requires_grad=True)
    b(a(x)).sum().backward()
    want = x.grad, a.weight.grad, b.weight.grad
    one = 3 * 8 * 4  # each linear saves its input, 3 x 8 float32
    for limit, moved in ((None, 2 * one), (host_block(one, pin=False), one), (0, 0)):
        saved = HostSaved(pin=False, host_limit=limit)
        for _ in range(2):
            x.grad = a.weight.grad = b.weight.grad = None
            with saved.scope(model):
                y = b(a(x))
            y.sum().backward()
            assert saved.counters() == {"saved_bytes_d2h": moved, "saved_bytes_h2d": moved,
                                        "saved_bytes_kept": 2 * one - moved}, limit
            assert all(torch.equal(g, w) for g, w in zip((x.grad, a.weight.grad, b.weight.grad), want))


def test_host_blocks_are_counted_as_the_pinned_allocator_rounds_them():
    from poros.engine.runtime.host_saved import host_block

    assert [host_block(n, pin=True) for n in (0, 1, 3, 1024, 1025, 3 << 30)] == [0, 1, 4, 1024, 2048, 4 << 30]
    assert host_block(1025, pin=False) == 1025


@pytest.mark.parametrize("setting,cuda,available,want", [
    ("auto", True, 110 * 10**9, int(110 * 10**9 / 1.1)),  # what the host has left, less a tenth as headroom
    (120 * 10**9, True, None, 76 * 10**9),  # an explicit budget holds the store and the saved tensors together
    (40 * 10**9, True, None, 0),  # a budget the store alone fills: every saved tensor stays on the device
    ("auto", True, None, None), ("auto", False, 10**9, None), (None, True, 10**9, None)])
def test_saved_host_limit_follows_host_budget(setting, cuda, available, want):
    from poros.engine.runtime.host_saved import saved_host_limit

    assert saved_host_limit(setting, 44 * 10**9, cuda, available) == want


def test_resident_gc_offload_within_a_host_budget_splits_its_inputs_and_keeps_the_bits(stores):
    """resident_gc_offload under a host_budget the store leaves little of: the first layers' inputs in host memory,
    the rest on the device, bitwise resident_gc still (and the budget met: what went is within it)."""
    store = stores("tiny-qwen3")
    cfg = _cfg("tiny-qwen3")
    room = 3 * 64 * store.config.hidden_size * 2  # three layer inputs of one micro-batch
    split = cfg.replace(host_budget=store.host_bytes + room)
    trainer = make_trainer(Method.RESIDENT_GC_OFFLOAD, store, split)
    try:
        c = trainer.step().counters
    finally:
        trainer.close()
    assert 0 < c["saved_bytes_d2h"] <= cfg.grad_accum * room and c["saved_bytes_kept"] > 0, c
    result = run_gate(make_trainer(Method.RESIDENT_GC, store, cfg), make_trainer(Method.RESIDENT_GC_OFFLOAD, store, split),
                      steps=2)
    assert result.ok, f"first mismatch {result.first_mismatch}"


METHOD_SETS = [
    ([Method.POROS, Method.RESIDENT, Method.UNSLOTH], (Method.RESIDENT, Method.POROS)),
    ([Method.POROS, Method.RESIDENT_GC, Method.UNSLOTH], (Method.RESIDENT_GC, Method.POROS)),
    ([Method.RESIDENT_GC, Method.POROS, Method.RESIDENT], (Method.RESIDENT, Method.POROS)),
    ([Method.RESIDENT, Method.RESIDENT_GC], (Method.RESIDENT, Method.RESIDENT_GC)),
    ([Method.POROS, Method.RESIDENT_GC_OFFLOAD, Method.UNSLOTH], (Method.RESIDENT_GC_OFFLOAD, Method.POROS)),
    ([Method.RESIDENT_GC_OFFLOAD, Method.RESIDENT_GC, Method.POROS], (Method.RESIDENT_GC, Method.POROS)),
    # a gated method is never timed ungated: resident QLoRA is its reference even where the set omits it
    ([Method.POROS, Method.UNSLOTH], (Method.RESIDENT, Method.POROS)),
    ([Method.POROS], (Method.RESIDENT, Method.POROS)),
    ([Method.RESIDENT_GC, Method.UNSLOTH], None),
    ([Method.RESIDENT], None),
    ([Method.UNSLOTH], None),
]


@pytest.mark.parametrize("methods,pair", METHOD_SETS, ids=lambda v: "-".join(m.value for m in v) if isinstance(
    v, list) else f"gate={'none' if v is None else v[0].value}")
def test_gate_of_a_method_set(methods, pair):
    assert gate_of(methods) == pair
    assert gated(methods) is (pair is not None)


@pytest.mark.parametrize("argv,gate,method", [
    (["--method", "resident_gc"], "resident", "resident_gc"),
    (["--gate", "resident_gc", "--sequential"], "resident_gc (recorded)", "poros"),
    (["--gate", "resident_gc", "--control"], "control", "resident_gc"),
    (["--gate", "resident_gc_offload", "--sequential", "--offload-inputs", "--device-inputs", "2"],
     "resident_gc_offload (recorded)", "poros"),
], ids=["resident_gc-vs-resident", "poros-vs-resident_gc-recorded", "control", "poros-split-vs-resident_gc_offload"])
def test_cli_parity_names_method_and_gate(capsys, argv, gate, method):
    import json

    from poros.cli import main

    assert main(["parity", "--model", "tiny-qwen3", "--seq-len", "64", "--steps", "1", *argv]) == 0
    line = json.loads(capsys.readouterr().out)
    assert (line["parity"], line["gate"], line["method"]) == ("PASS", gate, method)


def test_a_recorded_reference_leaves_its_states_host_memory_out_of_the_saved_tensors_limit(stores):
    """Recording resident_gc_offload's states for the gate takes host memory beside its saved tensors: their limit
    falls by what the states take (four copies of the LoRA weights a step, within the step counters' few bytes),
    so the two together stay within the host budget."""
    import torch

    from poros.engine.verify.parity import STATES_PER_STEP, RecordedReference

    store = stores("tiny-qwen3")
    cfg = _cfg("tiny-qwen3", host_budget=store.host_bytes + 10**7)
    trainer = make_trainer(Method.RESIDENT_GC_OFFLOAD, store, cfg)
    before = trainer.host_saved.host_limit
    try:
        recorded = RecordedReference(trainer, steps=2)
    finally:
        trainer.close()
    weights = sum(v.numel() * v.element_size() for v in recorded.init.values())
    assert before == 10**7 and trainer.host_saved.host_limit == before - STATES_PER_STEP * 2 * weights

    def nbytes(d):
        return sum(v.numel() * v.element_size() for v in d.values() if torch.is_tensor(v))

    held = sum(nbytes(s.grads) + nbytes(s.weights) + nbytes(s.adamw) for s in recorded.states)
    assert STATES_PER_STEP * 2 * weights <= held <= STATES_PER_STEP * 2 * weights * 1.01, (held, weights)
