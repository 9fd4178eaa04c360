"""`lora_compute: bf16`: LoRA matmuls in the activations' dtype, every method alike. Poros equals resident
under it; it computes other bits than peft's fp32 path (so it is in effect); a poros side left on fp32 FAILs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poros.config import LoRACompute, Method, TrainConfig
from poros.engine.model.lora_compute import CastLinear, lora_in_activation_dtype
from poros.engine.methods.registry import config_for, make_trainer
from poros.engine.verify.parity import parity
from poros.errors import ConfigError
from tests.capabilities import requires_bitsandbytes

pytestmark = requires_bitsandbytes

STEPS = 2


def config(model: str, **settings) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, lora_compute="bf16",
                       **settings)


def _adapter_linears(model: nn.Module) -> list[nn.Module]:
    return [lin for m in model.modules() if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
            for d in (m.lora_A, m.lora_B) for lin in d.values()]


@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma3",
                                   pytest.param("tiny-qwen3", marks=pytest.mark.slow),
                                   pytest.param("tiny-gemma4", marks=pytest.mark.slow)],
                         ids=lambda m: f"model={m}")
def test_poros_equals_resident(stores, model):
    """Streamed blocks of 2, two micro-batches: losses, gradients, LoRA weights and AdamW state torch.equal."""
    result = parity(config(model), steps=STEPS, store=stores(model))
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    assert result.max_abs_diff == 0.0


def test_resident_gc_equals_resident(stores):
    result = parity(config("tiny-gemma3"), steps=STEPS, store=stores("tiny-gemma3"), method=Method.RESIDENT_GC)
    assert result.ok, result.first_mismatch


def test_a_poros_side_computing_in_fp32_fails(stores):
    """Negative control: poros's adapters back on peft's fp32 path (its input cast turned on again, so each
    CastLinear casts its weight to fp32, a no-op) while resident computes in bf16: the first loss differs."""

    def fp32_poros(resident, poros):
        for m in poros.model.modules():
            if isinstance(getattr(m, "lora_A", None), nn.ModuleDict):
                m.cast_input_dtype_enabled = True

    result = parity(config("tiny-qwen2"), steps=STEPS, store=stores("tiny-qwen2"), mutate=fp32_poros)
    assert result.parity == "FAIL" and result.first_mismatch is not None
    assert result.first_mismatch.startswith("step0."), result.first_mismatch


def test_bf16_computes_other_bits_than_fp32_and_keeps_fp32_state(stores):
    """The setting reaches the arithmetic (the losses of one step differ from peft's fp32 path, trained from the
    same init), while the adapters, their gradients and AdamW's moments stay fp32 under the same names."""
    store = stores("tiny-qwen2")
    runs = {}
    for value in LoRACompute:
        trainer = make_trainer(Method.RESIDENT, store, config("tiny-qwen2").replace(lora_compute=value))
        try:
            losses = [trainer.step().loss for _ in range(2)]
            for _ in trainer.accumulate_step(trainer.batches(2)):  # the third step's gradients, not applied
                pass
            runs[value] = (losses, trainer.lora_state(), trainer.lora_grads(), trainer.optimizer_state())
            kinds = {type(lin) for lin in _adapter_linears(trainer.model)}
            assert kinds == ({CastLinear} if value is LoRACompute.BF16 else {nn.Linear}), kinds
        finally:
            trainer.close()
    (fp_losses, fp_state, _, _), (bf_losses, bf_state, bf_grads, bf_moments) = runs[LoRACompute.FP32], \
        runs[LoRACompute.BF16]
    assert fp_state.keys() == bf_state.keys()
    assert fp_losses[1] != bf_losses[1]
    assert any(not torch.equal(fp_state[k], bf_state[k]) for k in fp_state)
    assert {t.dtype for t in bf_state.values()} == {torch.float32}
    assert {g.dtype for g in bf_grads.values()} == {torch.float32}
    assert {t.dtype for k, t in bf_moments.items() if not k.endswith(":step")} == {torch.float32}


def test_cast_linear_keeps_the_parameters_and_casts_per_call():
    layer = nn.Module()
    layer.lora_A = nn.ModuleDict({"default": nn.Linear(8, 2, bias=False)})
    layer.lora_B = nn.ModuleDict({"default": nn.Linear(2, 8, bias=False)})
    before = dict(layer.state_dict())
    weight = layer.lora_A["default"].weight
    assert lora_in_activation_dtype(layer) == 1
    assert layer.lora_A["default"].weight is weight and layer.cast_input_dtype_enabled is False
    assert layer.state_dict().keys() == before.keys()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    out = layer.lora_A["default"](x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x @ weight.to(torch.bfloat16).t())


def test_an_adapter_that_is_not_a_linear_is_refused():
    layer = nn.Module()
    layer.lora_A = nn.ModuleDict({"default": nn.Embedding(4, 2)})
    layer.lora_B = nn.ModuleDict({"default": nn.Linear(2, 8)})
    with pytest.raises(ConfigError, match="lora_A.default is Embedding"):
        lora_in_activation_dtype(layer)


def test_unsloth_rows_say_bf16_and_gated_methods_keep_the_setting():
    """Unsloth's kernels cast its adapters to bf16 whatever the setting; every gated method keeps it."""
    cfg = TrainConfig(model="tiny-qwen2")
    assert config_for(Method.UNSLOTH, cfg).lora_compute is LoRACompute.BF16
    assert all(config_for(m, cfg) is cfg for m in (Method.POROS, Method.RESIDENT, Method.RESIDENT_GC))


def test_an_unknown_value_is_refused():
    with pytest.raises(ConfigError, match="lora_compute: expected one of fp32, bf16, got 'fp16'"):
        TrainConfig(model="tiny-qwen2", lora_compute="fp16")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen2", pytest.param("tiny-gemma3", marks=pytest.mark.extended)],
                         ids=lambda m: f"model={m}")
def test_compiled_poros_equals_compiled_resident(stores, model):
    """Both settings that make long context fast, together: compiled layers computing LoRA in bf16 (a dense and
    a sliding-window family; every family is compiled in fp32 in test_compile.py, and in bf16 eager above)."""
    torch._dynamo.reset()
    try:
        result = parity(config(model, compile=True), steps=STEPS, store=stores(model))
    finally:
        torch._dynamo.reset()
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
