"""The chunked head (`loss_chunk`): bitwise the model's own loss and gradients on the CPU, one chunk of
logits at a time, and poros bitwise equal to resident QLoRA with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from poros.config import Method, TrainConfig
from poros.engine.model.head import IGNORE_INDEX, chunked_loss
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import run_gate

TINY = ["tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4"]
HIDDEN, VOCAB = 32, 500


def _problem(seed: int, softcap: float | None):
    """Final hidden states, a frozen lm_head (as in QLoRA) and labels (some ignored), in the model's dtypes."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 100, HIDDEN, generator=gen).bfloat16().requires_grad_(True)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).bfloat16()
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen) * 0.2)
    head.weight.requires_grad_(False)
    labels = torch.randint(0, VOCAB, (3, 100), generator=gen)
    labels[0, :10] = IGNORE_INDEX  # e.g. a masked prompt
    return hidden, head, labels, softcap


def _models_loss(hidden, head, labels, softcap, **kw):
    """The Hugging Face causal-LM head and loss (what Qwen/Gemma's forward computes)."""
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return ForCausalLMLoss(logits, labels, VOCAB, **kw)


def _loss_and_grads(fn, seed, softcap, **kw):
    hidden, head, labels, softcap = _problem(seed, softcap)
    loss = fn(hidden, head, labels, softcap, **kw)
    loss.backward()
    return loss.detach(), hidden.grad


@pytest.mark.parametrize("num_items", [None, 250], ids=lambda n: f"num_items={n}")
@pytest.mark.parametrize("softcap", [None, 30.0], ids=lambda c: f"softcap={c}")
@pytest.mark.parametrize("chunk", [7, 64, 300, 1000], ids=lambda c: f"chunk={c}")
def test_chunked_loss_is_bitwise_the_models_loss(chunk, softcap, num_items):
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = _loss_and_grads(_models_loss, 0, softcap, **kw)
    got = _loss_and_grads(lambda h, m, y, c, **k: chunked_loss(h, y, m, c, chunk, k.get("num_items_in_batch")),
                          0, softcap, **kw)
    for name, a, b in zip(("loss", "hidden.grad"), want, got, strict=True):
        assert torch.equal(a, b), f"{name} differs: max |diff| {(a.float() - b.float()).abs().max():.3e}"


def test_summing_the_chunks_losses_is_not_the_models_loss():
    """Negative control: adding per-chunk losses changes the loss's bits (so the test above can fail; the
    chunked head keeps the model's reduction over all tokens instead)."""
    def chunk_sums(hidden, head, labels, softcap):
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
        rows = hidden.reshape(-1, HIDDEN)
        total = sum(F.cross_entropy(head(h).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")
                    for h, y in zip(torch.split(rows, 7), torch.split(shifted, 7)))
        return total / (shifted != IGNORE_INDEX).sum()

    want, naive = _loss_and_grads(_models_loss, 0, None), _loss_and_grads(chunk_sums, 0, None)
    assert not torch.equal(want[0], naive[0]), "the two orders of summation agree for this data: pick another seed"
    assert torch.allclose(want[0], naive[0], rtol=1e-5)  # the same quantity


def test_one_chunk_of_logits_at_a_time():
    """The lm_head runs on at most `loss_chunk` rows, each chunk once in forward and once again in backward,
    and no tensor of vocabulary width is kept from the forward for the backward."""
    hidden, head, labels, _ = _problem(0, None)
    rows, kept = [], []
    head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))

    def pack(t):
        kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_loss(hidden, labels, head, None, 64)
    forward_rows = list(rows)
    loss.backward()
    assert forward_rows == [64, 64, 64, 64, 44] and rows == forward_rows + forward_rows[::-1], rows
    assert not [s for s in kept if s and s[-1] == VOCAB], f"vocabulary-wide tensors kept: {kept}"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # control: the model's own head keeps them
        _models_loss(*_problem(0, None))
    assert [s for s in kept if s and s[-1] == VOCAB]


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_loss_chunk_trains_bitwise_as_the_models_loss(stores, model):
    """Resident QLoRA with `loss_chunk` (three uneven chunks of 64 tokens) against resident with the
    model's own loss: every loss, gradient, weight and AdamW state equal on the CPU."""
    cfg = TrainConfig(model=model, seq_len=64, grad_accum=2, lr=1e-2)
    result = run_gate(make_trainer(Method.RESIDENT, stores(model), cfg),
                      make_trainer(Method.RESIDENT, stores(model), cfg.replace(loss_chunk=24)), steps=2)
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


@pytest.mark.parametrize("model", TINY, ids=lambda m: f"model={m}")
def test_poros_with_loss_chunk_is_bitwise_resident_with_it(stores, model):
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, loss_chunk=24)
    result = run_gate(make_trainer(Method.RESIDENT, stores(model), cfg),
                      make_trainer(Method.POROS, stores(model), cfg), steps=2)
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


def test_loss_chunk_with_another_lr_fails(stores):
    """Negative control: the same comparison sees a trainer computing something else."""
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, lr=1e-2, loss_chunk=24)
    result = run_gate(make_trainer(Method.RESIDENT, stores("tiny-qwen3"), cfg),
                      make_trainer(Method.POROS, stores("tiny-qwen3"), cfg.replace(lr=2e-2)), steps=1)
    assert result.parity == "FAIL" and result.first_mismatch.startswith("step0.weight:"), result.first_mismatch
