"""LoRA matmuls in the activations' dtype (`lora_compute: bf16`).

peft computes an adapter in its weights' dtype: around every projection it casts the activation up to
the fp32 adapters, multiplies in fp32 and casts the product back. At long context those casts of
activations (up to seq x intermediate size) and fp32 matmuls are a large share of a step
(experiments/h200-profile-16k). With `bf16` the rank-r adapter weights are cast down to the activation's dtype
at each call instead, the arithmetic of Unsloth's LoRA kernels; the weights, their gradients (autograd
casts them back up) and the optimizer state stay fp32. Every method builds its model here, so every
method computes the same products.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from poros.errors import ConfigError


class CastLinear(nn.Linear):
    """An `nn.Linear` whose weight (and bias) is cast to its input's dtype at each call."""

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


def _cast_linear(linear: nn.Module, where: str) -> CastLinear:
    """`linear` as a `CastLinear` holding the same parameters (the same tensors, names and state dict)."""
    if type(linear) is not nn.Linear:
        raise ConfigError([f"lora_compute: bf16 computes nn.Linear adapters; {where} is "
                           f"{type(linear).__name__}"], source="TrainConfig")
    cast = CastLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    cast.weight = linear.weight
    if linear.bias is not None:
        cast.bias = linear.bias
    return cast.train(linear.training)


def lora_in_activation_dtype(model: nn.Module) -> int:
    """Make every peft LoRA layer of `model` compute its adapters in its input's dtype: peft's input cast
    off, each adapter linear a `CastLinear`. Returns how many LoRA layers changed."""
    n = 0
    for name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
            continue
        module.cast_input_dtype_enabled = False  # peft's `_cast_input_dtype` leaves the input as it is
        for adapters, which in ((lora_a, "lora_A"), (lora_b, "lora_B")):
            for adapter in list(adapters.keys()):
                adapters[adapter] = _cast_linear(adapters[adapter], f"{name}.{which}.{adapter}")
        n += 1
    return n
