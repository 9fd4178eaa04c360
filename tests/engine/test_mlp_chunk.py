"""The chunked MLP (`mlp_chunk`): one chunk's intermediates at a time in forward and backward, every method
bitwise equal to resident QLoRA with the same chunk (negative controls: without the chunk, with a chunk that
reads a shifted token range), what the CPU shows against the whole sequence's MLP, and the planner's count."""

from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from poros.config import Method, TrainConfig
from poros.engine.model import mlp_chunk as M
from poros.engine.model import seq_chunks
from poros.engine.model.dropout import DropoutKeys, KeyedDropout
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import parity, run_gate
from poros.engine.planning.memory import ACT_INTERMEDIATE, layer_activation_bytes, resident_memory, transient_bytes
from poros.engine.planning.search import build_plan
from poros.errors import ConfigError
from poros.choices import Attention
from tests.capabilities import requires_bitsandbytes
from tests.engine.chunk_gates import SEQ, STEPS, TINY, assert_pass, compiled_gate, config, shift_chunks, templates_gate
from tests.plans import plan_request

pytestmark = requires_bitsandbytes

CHUNKS = [32, 48]  # four chunks of 32; and 48, 48, 32: a chunk that does not divide the sequence


# --- every method with the same chunk is bitwise equal ----------------------------------------------------


GATES = [(m, 48) for m in TINY] + [("tiny-qwen2", 32)] + [
    pytest.param(m, 32, marks=pytest.mark.slow) for m in TINY[1:]]


@pytest.mark.parametrize("model,chunk", GATES, ids=lambda v: f"model={v}" if isinstance(v, str) else f"mlp_chunk={v}")
def test_poros_equals_resident(stores, model, chunk):
    """Losses, every LoRA gradient, LoRA weights and AdamW state torch.equal over 3 steps."""
    assert_pass(parity(config(model, mlp_chunk=chunk), steps=STEPS, store=stores(model)))


@pytest.mark.parametrize("model", ["tiny-qwen3", pytest.param("tiny-gemma4", marks=pytest.mark.slow)],
                         ids=lambda m: f"model={m}")
def test_resident_gc_equals_resident(stores, model):
    """resident_gc's layer checkpoints hold the MLP's chunk checkpoints (nested): the same bits."""
    assert_pass(parity(config(model, mlp_chunk=48), steps=STEPS, store=stores(model), method=Method.RESIDENT_GC))


@pytest.mark.parametrize("settings", [
    dict(overlap_backward=False),
    dict(accumulation="micro", block_size=1),
    dict(offload_inputs=True),
    dict(keep_attention=True),
    dict(batch_size=2),
    dict(lora_dropout=0.3),  # each chunk's masks pinned for its recompute on poros's backward thread
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_poros_equals_resident_across_schedules(stores, settings):
    assert_pass(parity(config("tiny-gemma3", mlp_chunk=48, **settings), steps=STEPS, store=stores("tiny-gemma3")))


def test_resident_gc_equals_resident_with_dropout(stores):
    assert_pass(parity(config("tiny-qwen2", mlp_chunk=48, lora_dropout=0.3), steps=STEPS, store=stores("tiny-qwen2"),
                       method=Method.RESIDENT_GC))


@pytest.mark.parametrize("capture,keep", [
    pytest.param(False, False, id="templates=eager"), pytest.param(True, False, id="templates=stand-in-graphs"),
    pytest.param(True, True, id="templates=stand-in-graphs-kept"),
    pytest.param(False, True, id="templates=eager-kept", marks=pytest.mark.slow)])
def test_layer_templates_equal_resident(stores, monkeypatch, capture, keep):
    """Layer templates run their own copies of the layers, chunked: eagerly (as without capture), or on the
    capture path with CPU stand-ins for the CUDA graph API (each template captured once, then replayed; a kept
    template's backward replay is a second backward over its retained autograd graph, which recomputes the
    chunks again). With kept activations the resident layers run the chunks with autograd and keep only their
    checkpoints."""
    templates_gate(stores, monkeypatch, capture, keep, mlp_chunk=48)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_compile_caches")
# poros's side in CI; the templates' and resident_gc's sides compile the same chunked layers (pytest -m extended)
@pytest.mark.parametrize("side", ["poros", pytest.param("poros-templates", marks=pytest.mark.extended),
                                  pytest.param("resident_gc", marks=pytest.mark.extended)], ids=lambda s: f"method={s}")
def test_compiled_methods_equal_compiled_resident(stores, side):
    """Compiled layers trace the chunks' checkpoints into their graphs (torch.compile's activation
    checkpointing); every method compiles the same layers, so the bits agree."""
    compiled_gate(stores, side, mlp_chunk=48)


@pytest.mark.usefixtures("fresh_compile_caches")
@pytest.mark.parametrize("side", ["poros", pytest.param("resident_gc", marks=[pytest.mark.slow, pytest.mark.extended])],
                         ids=lambda s: f"method={s}")
def test_compiled_layers_with_an_eager_mlp_equal_compiled_resident(stores, side):
    """compile_mlp off: every method's layers compiled but for their MLP, which runs eager between the compiled
    parts (poros's recompute then defers its chunks to the backward); the bits agree."""
    compiled_gate(stores, side, mlp_chunk=48, compile_mlp=False)


# --- negative controls: the gate sees a side that chunks otherwise ----------------------------------------


def test_a_side_without_the_chunk_fails(stores):
    cfg = config("tiny-qwen2", mlp_chunk=32)
    result = run_gate(make_trainer(Method.RESIDENT, stores("tiny-qwen2"), cfg),
                      make_trainer(Method.POROS, stores("tiny-qwen2"), cfg.replace(mlp_chunk=None)), steps=1)
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_a_chunk_reading_a_shifted_token_range_fails(stores):
    def mutate(resident, poros):
        for layer in poros.qlora.layers:
            shift_chunks(layer.mlp, layer.mlp.mlp_chunk)

    result = parity(config("tiny-qwen2", mlp_chunk=48), steps=1, store=stores("tiny-qwen2"), mutate=mutate)
    assert result.parity == "FAIL" and result.first_mismatch == "step0.micro0.loss", result.first_mismatch


# --- poros's recompute computes each chunk once, in its backward ---------------------------------------------


def _mlp_rows(monkeypatch, trainer) -> dict:
    """A counter of the tokens every MLP forward of `trainer`'s model runs (its class's forward, which each chunk
    calls)."""
    cls = type(trainer.qlora.layers[0].mlp)
    rows, forward = {"n": 0}, cls.forward

    def counting(self, x):
        rows["n"] += x.shape[-2] * x.shape[0]
        return forward(self, x)

    monkeypatch.setattr(cls, "forward", counting)
    return rows


@pytest.mark.parametrize("model,deferred", [("tiny-qwen2", True), ("tiny-qwen3", True), ("tiny-gemma3", False)],
                         ids=lambda v: f"model={v}" if isinstance(v, str) else f"deferred={v}")
def test_poros_runs_a_residual_mlp_twice_a_step_not_three_times(stores, monkeypatch, model, deferred):
    """poros's recompute leaves the chunked MLP's output uncomputed where its layer's MLP feeds the residual add
    alone (qwen2, qwen3): each chunk runs in the forward and once in the backward. gemma3's post-feedforward norm
    reads the output, so there (the control) every chunk runs a third time, in its checkpoint's recompute."""
    cfg = config(model, mlp_chunk=32, grad_accum=1)
    trainer = make_trainer(Method.POROS, stores(model), cfg)
    rows = _mlp_rows(monkeypatch, trainer)
    trainer.step()
    layers, tokens = len(trainer.qlora.layers), cfg.seq_len * cfg.batch_size
    assert rows["n"] == (2 if deferred else 3) * layers * tokens


@pytest.mark.usefixtures("fresh_compile_caches")
@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "control-not-deferred"])
def test_compiled_layers_with_an_eager_mlp_run_it_twice_a_step(stores, monkeypatch, defer):
    """compile_mlp off: the compiled layer's recompute leaves its eager MLP's chunks to the backward, so each runs
    twice a step; the control, the recompute not deferring, runs each a third time (its checkpoint's recompute)."""
    cfg = config("tiny-qwen2", mlp_chunk=32, grad_accum=1, compile=True, compile_mlp=False)
    trainer = make_trainer(Method.POROS, stores("tiny-qwen2"), cfg)
    if not defer:
        for runner in trainer.runners:
            runner.eager_mlp = False
    rows = _mlp_rows(monkeypatch, trainer)
    trainer.step()
    layers, tokens = len(trainer.qlora.layers), cfg.seq_len * cfg.batch_size
    assert rows["n"] == (2 if defer else 3) * layers * tokens


@pytest.mark.usefixtures("fresh_compile_caches")
def test_a_compiled_layers_eager_mlp_summed_first_to_last_fails(stores, monkeypatch):
    """Negative control: compile_mlp off, the deferred backward summing the chunks' LoRA gradients in the wrong
    order, and the gate of the compiled layers sees it."""
    monkeypatch.setattr(seq_chunks, "backward_order", lambda n: range(n))
    result = parity(config("tiny-qwen2", mlp_chunk=32, compile=True, compile_mlp=False), steps=1,
                    store=stores("tiny-qwen2"))
    assert result.parity == "FAIL" and "lora" in result.first_mismatch, result.first_mismatch


def test_chunks_summed_first_to_last_in_the_backward_fail(stores, monkeypatch):
    """Negative control: the deferred backward summing the chunks' LoRA gradients first to last, not in autograd's
    order, changes their bits and the gate sees it."""
    monkeypatch.setattr(seq_chunks, "backward_order", lambda n: range(n))
    result = parity(config("tiny-qwen2", mlp_chunk=32), steps=1, store=stores("tiny-qwen2"))
    assert result.parity == "FAIL" and "lora" in result.first_mismatch, result.first_mismatch


def test_a_layer_that_reads_the_mlp_output_must_not_defer_it(stores):
    """Negative control for the declared gate: gemma3's MLP deferred anyway, its post-feedforward norm reads the
    uncomputed output, and the gate fails."""
    def mutate(resident, poros):
        for layer in poros.qlora.layers:
            setattr(layer.mlp, M.DEFERRABLE_ATTR, True)

    result = parity(config("tiny-gemma3", mlp_chunk=32), steps=1, store=stores("tiny-gemma3"), mutate=mutate)
    assert result.parity == "FAIL", result.first_mismatch


# --- the chunked MLP itself ------------------------------------------------------------------------------


def _mlp(stores, model: str, chunk: int, **settings):
    """Layer 0's MLP of a resident trainer (LoRA B non-zero, so the adapters change the output), chunked."""
    trainer = make_trainer(Method.RESIDENT, stores(model), config(model, mlp_chunk=chunk, **settings))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return trainer, trainer.qlora.layers[0].mlp


def _run(mlp, forward, x: torch.Tensor):
    """Output, input gradient and LoRA gradients of `forward` on `x` (a fixed incoming gradient)."""
    loras = [(n, p) for n, p in mlp.named_parameters() if p.requires_grad]
    for _, p in loras:
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = forward(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in loras}


@pytest.mark.parametrize("batch", [1, 2], ids=lambda b: f"batch={b}")
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"mlp_chunk={c}")
@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_against_the_whole_sequence_on_the_cpu(stores, model, chunk, batch):
    """What the CPU shows: each token's output and input gradient is bitwise the whole sequence's MLP's (a
    row's result does not depend on how many rows a CPU matmul computes), and no-grad forwards agree too.
    The LoRA weight gradients differ: each chunk's contribution is summed on its own, then added to the
    others', which is why runs with mlp_chunk are compared only with runs with the same mlp_chunk."""
    trainer, mlp = _mlp(stores, model, chunk)
    whole = type(mlp).forward.__get__(mlp)
    x = torch.randn(batch, SEQ, trainer.store.config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16)
    got, want = _run(mlp, mlp, x), _run(mlp, whole, x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with torch.no_grad():
        assert torch.equal(mlp(x), whole(x))
    assert sorted(got[2]) == sorted(want[2]) and len(got[2]) == 6  # gate, up, down: A and B
    assert any(not torch.equal(got[2][n], want[2][n]) for n in got[2])
    trainer.close()


def _watch(mlp, forward, x, intermediate: int) -> tuple[list, list, list]:
    """Runs `forward` on `x` with autograd, then its backward, and returns (the rows each gate projection call
    ran, how many intermediate-width tensors the forward saved for the backward, and at each call in the
    backward how many of the intermediate-width outputs made so far were still alive)."""
    rows, saved, alive_at, made = [], [], [], []
    backward = [False]

    def pre(module, args):
        rows.append(args[0].shape[-2])
        if backward[0]:
            alive_at.append(sum(not w.expired() for w in made))

    def post(module, args, out):
        if out.shape[-1] == intermediate:
            made.append(StorageWeakRef(out.untyped_storage()))

    def pack(t):
        saved.append(t.shape[-1] == intermediate)
        return t

    hooks = [mlp.gate_proj.register_forward_pre_hook(pre)] + [c.register_forward_hook(post) for c in mlp.children()]
    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    backward[0] = True
    out.backward(torch.ones_like(out))
    for h in hooks:
        h.remove()
    return rows, saved, alive_at


def test_one_chunk_of_intermediates_at_a_time(stores):
    """The forward saves no intermediate-width tensor for the backward, and the backward recomputes the chunks
    in reverse order, each once, none of the earlier chunks' intermediates alive when the next is recomputed.
    Controls: the whole sequence's MLP saves its intermediates, and so do chunks without checkpoints, all of
    them at once."""
    trainer, mlp = _mlp(stores, "tiny-gemma3", 32)
    intermediate = trainer.store.config.intermediate_size
    x = torch.randn(1, 100, trainer.store.config.hidden_size).to(torch.bfloat16)
    rows, saved, alive_at = _watch(mlp, mlp, x, intermediate)
    assert rows == [32, 32, 32, 4] + [4, 32, 32, 32], rows
    assert not any(saved), "the chunked MLP saved intermediate-width tensors for its backward"
    assert alive_at == [0, 0, 0, 0], alive_at

    whole = type(mlp).forward.__get__(mlp)
    rows, saved, alive_at = _watch(mlp, whole, x, intermediate)
    assert rows == [100] and sum(saved) >= 2 and alive_at == []

    def unchecked(x):
        return torch.cat([whole(part) for part in torch.split(x, 32, dim=-2)], dim=-2)

    rows, saved, _ = _watch(mlp, unchecked, x, intermediate)
    assert rows == [32, 32, 32, 4] and sum(saved) >= 2 * 4
    trainer.close()


def test_a_copy_of_a_layer_runs_its_own_modules(stores):
    """The forward is bound to its module, so a deep copy (a layer template) is chunked over its own LoRA
    weights. Control: a forward closing over the original module would run the original's from the copy."""
    trainer, mlp = _mlp(stores, "tiny-qwen2", 48)
    layer = trainer.qlora.layers[0]
    x = torch.randn(1, SEQ, trainer.store.config.hidden_size).to(torch.bfloat16)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        for p in twin.mlp.parameters():
            if p.requires_grad:
                p.mul_(2)
        assert twin.mlp.forward.__self__ is twin.mlp
        assert not torch.equal(twin.mlp(x), mlp(x))
        layer.mlp.forward = lambda h: M.chunked_forward(mlp, h)  # the control
        closed = copy.deepcopy(layer)
        for p in closed.mlp.parameters():
            if p.requires_grad:
                p.mul_(2)
        assert torch.equal(closed.mlp(x), mlp(x))
    trainer.close()


def test_a_layer_without_an_mlp_is_refused():
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(ConfigError) as e:
        M.use_chunked_mlp(layers, 8)
    assert e.value.problems == ["mlp_chunk: chunks a decoder layer's `mlp` module, and layer 0 (Linear) has none; "
                                "drop mlp_chunk for this model"]


# --- LoRA dropout: each chunk's masks, pinned for its recompute ------------------------------------------


def test_pinned_keys():
    """A pin holds the keys a chunk first ran under, on its own thread; each chunk its own masks."""
    keys = DropoutKeys(seed=5)
    drop = KeyedDropout(0.5, keys, index=3).train()
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    live = drop(x)
    with keys.pinned(0, 0, 0):
        first = drop(x)
    with keys.pinned(0, 0, 1):
        assert not torch.equal(drop(x), first)  # another chunk: another mask
    assert not torch.equal(first, live)  # a chunk's masks are keyed by it
    keys.micro = 1  # the keys move on; the pin still draws the chunk's masks of micro-batch 0
    with keys.pinned(0, 0, 0):
        assert torch.equal(drop(x), first)
    seen = {}
    with keys.pinned(0, 0, 0):
        worker = threading.Thread(target=lambda: seen.setdefault("other thread", drop(x)))
        worker.start()
        worker.join()
    assert torch.equal(seen["other thread"], drop(x)) and not torch.equal(seen["other thread"], first)


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "control-unpinned"])
def test_the_recompute_draws_the_forwards_masks_after_the_keys_move(stores, monkeypatch, pin):
    """Keys moved between a chunked forward and its backward (as poros's thread moves them while its backward
    thread recomputes) leave the gradients as they are. Control: without the pin the recompute draws the moved
    keys' masks, and the gradients differ."""
    if not pin:
        monkeypatch.setattr(DropoutKeys, "pinned", lambda self, step, micro, chunk: contextlib.nullcontext())
    trainer, mlp = _mlp(stores, "tiny-qwen2", 48, lora_dropout=0.3)
    keys = trainer.qlora.dropout_keys
    x = torch.randn(1, SEQ, trainer.store.config.hidden_size).to(torch.bfloat16)

    def grads(move: bool):
        keys.micro = 0
        x_ = x.clone().requires_grad_(True)
        out = mlp(x_)
        if move:
            keys.micro = 1
        out.backward(torch.ones_like(out))
        return x_.grad

    still, moved = grads(False), grads(True)
    assert torch.equal(still, moved) is pin
    trainer.close()


# --- the planner's memory model ---------------------------------------------------------------------------


def test_the_layer_transient_shrinks_with_the_chunk(q72):
    """One chunk's MLP intermediates (mlp_chunk tokens of each sequence) in place of the micro-batch's."""
    seq, batch = 32768, 2
    layer = {c: transient_bytes(q72, seq, batch, Attention.FAST, overlap=False, mlp_chunk=c)[1]
             for c in (None, 16384, 4096, 1024, seq, 10 * seq)}
    assert layer[None] > layer[16384] > layer[4096] > layer[1024]
    for c in (16384, 4096, 1024):
        assert layer[None] - layer[c] == (seq - c) * batch * ACT_INTERMEDIATE * q72.intermediate
    assert layer[seq] == layer[10 * seq] == layer[None]  # a chunk of the whole sequence or more: no change
    assert transient_bytes(q72, seq, batch, Attention.FAST, overlap=True, mlp_chunk=4096)[1] == 2 * layer[4096]


def test_kept_activations_and_resident_count_one_chunk(q72):
    """A layer's forward keeps none of a chunked MLP's intermediates; resident QLoRA holds one chunk's while a
    layer's backward recomputes it, beside its dequantized weight (where the head's logits are the larger
    transient, that chunk costs nothing more)."""
    seq, chunk, per_token = 16384, 2048, ACT_INTERMEDIATE * q72.intermediate
    whole = layer_activation_bytes(q72, seq, 1, Attention.FAST)
    assert whole - layer_activation_bytes(q72, seq, 1, Attention.FAST, chunk) == seq * per_token
    for loss_chunk, chunk_costs in ((4096, 0), (1, chunk * per_token)):
        cfg = TrainConfig(model="qwen2.5-72b", seq_len=seq, attention="fast", loss_chunk=loss_chunk)
        saved = resident_memory(q72, cfg) - resident_memory(q72, cfg.replace(mlp_chunk=chunk))
        assert saved == q72.n_layers * seq * per_token - chunk_costs, loss_chunk


def test_a_plan_with_the_chunk_predicts_less(q72):
    cfg = TrainConfig(model="qwen2.5-72b", seq_len=32768, attention="fast", loss_chunk=4096, device="cuda")
    plain = build_plan(q72, plan_request(cfg, offload_inputs=True))
    chunked = build_plan(q72, plan_request(cfg.replace(mlp_chunk=4096), offload_inputs=True))
    assert chunked.memory.transient < plain.memory.transient and chunked.memory.total < plain.memory.total
