"""Attention backends (poros/engine/model/attention.py): `fast` is one more backend list for every method alike, and
each row records which backend every attention shape ran on."""

from __future__ import annotations

import pytest

from poros.engine.model.attention import BackendLog, sdpa_context, shape_label
from poros.config import Method, TrainConfig
from poros.errors import CapabilityError
from poros.choices import Attention
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import run_gate


@pytest.mark.parametrize("model", ["tiny-gemma3", "tiny-qwen3"])
def test_fast_keeps_parity_and_both_methods_record_the_same_backends(stores, model):
    store = stores(model)
    cfg = TrainConfig(model=model, seq_len=64, block_size=2, attention="fast", lr=1e-2)
    resident, poros = make_trainer(Method.RESIDENT, store, cfg), make_trainer(Method.POROS, store, cfg)
    assert run_gate(resident, poros, 1).ok
    resident.step(), poros.step()
    assert resident.attention_backends and resident.attention_backends == poros.attention_backends
    # on the CPU torch's flash kernel serves every shape the list reaches first
    assert set(resident.attention_backends.values()) == {"flash"}


def test_math_records_math_for_every_shape(stores):
    store = stores("tiny-gemma3")  # sliding-window (masked) and full layers: two shapes
    trainer = make_trainer(Method.RESIDENT, store, TrainConfig(model="tiny-gemma3", seq_len=64, attention="math"))
    trainer.step()
    assert len(trainer.attention_backends) == 2 and set(trainer.attention_backends.values()) == {"math"}
    assert any(k.endswith(", mask") for k in trainer.attention_backends)


def test_the_log_restores_sdpa_and_labels_calls():
    import torch
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention
    q = torch.randn(1, 4, 8, 16)
    with BackendLog() as log:
        assert F.scaled_dot_product_attention is not real
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert F.scaled_dot_product_attention is real
    assert torch.equal(out, real(q, q, q, is_causal=True))
    assert list(log.seen) == [shape_label(q, q, None, True)] == ["head_dim 16, heads 4/4, causal"]


def test_layers_replayed_from_templates_still_record_their_backends(stores):
    """With layer templates (CUDA graphs on a GPU) Python runs attention only on the first call, the
    gate's: that call records the backends, and later steps keep them."""
    store = stores("tiny-qwen3")
    cfg = TrainConfig(model="tiny-qwen3", seq_len=64, block_size=2, attention="math")
    resident, poros = make_trainer(Method.RESIDENT, store, cfg), make_trainer(Method.POROS, store, cfg)
    poros.use_layer_templates(capture=False)
    assert run_gate(resident, poros, 1).ok
    assert poros.attention_backends == resident.attention_backends == {"head_dim 32, heads 4/2, causal": "math"}
    poros.step()
    assert poros.attention_backends == resident.attention_backends


def test_a_shape_no_backend_of_the_setting_serves_is_a_clear_error():
    """On the CPU torch has no memory-efficient kernel: `efficient` alone serves nothing, and the first call
    says which shape and what to do instead of SDPA's bare error; `fast` serves the same call."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, 4, 64, 16)
    with BackendLog() as log, sdpa_context(Attention.EFFICIENT):
        with pytest.raises(CapabilityError, match=r"serves head_dim 16, heads 4/4, causal: .*--attention fast"):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with BackendLog() as log, sdpa_context(Attention.FAST):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert log.seen == {"head_dim 16, heads 4/4, causal": "flash"}


def test_a_trainer_on_a_setting_without_a_kernel_stops_with_the_clear_error(stores):
    trainer = make_trainer(Method.RESIDENT, stores("tiny-qwen3"), TrainConfig(model="tiny-qwen3", seq_len=64,
                                                                                 attention="efficient"))
    with pytest.raises(CapabilityError, match=r"no attention kernel of the chosen setting serves head_dim 32"):
        trainer.step()
