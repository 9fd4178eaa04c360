"""The chunked MLP (`mlp_chunk`): every decoder layer's MLP on `mlp_chunk` tokens of the sequence at a time.

At long context a decoder layer's MLP holds more than the rest of its forward and backward: the gate and up
projections' outputs, the activation and its product (intermediate width, 3.6 times the hidden width on
qwen2.5-72b), and LoRA's fp32 copies of the inputs of the down projection. The chunked MLP runs the family's own
MLP module, its peft LoRA layers inside its projections included, on one chunk of the sequence at a time, each
chunk under non-reentrant checkpointing, so one chunk's intermediates are alive at a time: in the forward (they
are dropped as each chunk ends) and in the backward (each chunk recomputed just before its backward). The
outputs are concatenated along the sequence.

The MLP's matmuls then run on fewer rows, and each LoRA weight gradient is summed chunk by chunk, so the bits
differ from the unchunked MLP's (on the CPU each token's output and input gradient stay the same, the LoRA
weight gradients do not: tests/engine/test_mlp_chunk.py). It is a setting of what is computed, shared by every
method of a run: every method runs the same chunks through the same kernels, whether its layer runs eagerly,
recomputed, compiled (the chunks' checkpoints traced into the layer's graph) or from a layer template.

LoRA dropout (`lora_dropout`) draws each chunk's masks under keys of its own (the step and micro-batch of the
chunk's first run, and the chunk's index), pinned for the chunk's recompute: poros may run that recompute on its
backward thread while its own thread has moved the keys on to the next layer (poros/engine/dropout.py).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from poros.engine.dropout import DropoutKeys, KeyedDropout
from poros.errors import ConfigError

CHUNK_ATTR = "mlp_chunk"  # tokens per chunk, on each chunked MLP module (a layer template's copy keeps it)


def mlp_of(layer: nn.Module, where: str) -> nn.Module:
    """A decoder layer's MLP module (`layer.mlp` in every Hugging Face decoder family).

    Raises:
        ConfigError: the layer has none, naming its class.
    """
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise ConfigError([f"mlp_chunk: chunks a decoder layer's `mlp` module, and {where} "
                           f"({type(layer).__name__}) has none; drop mlp_chunk for this model"], source="TrainConfig")
    return mlp


def _dropout_keys(mlp: nn.Module) -> DropoutKeys | None:
    """The keys the MLP's LoRA dropout draws from (None without `lora_dropout`)."""
    return next((m.keys for m in mlp.modules() if isinstance(m, KeyedDropout)), None)


def _run_chunk(forward, x: torch.Tensor, keys: DropoutKeys | None, pin: tuple | None) -> torch.Tensor:
    """The MLP's own forward on one chunk, its dropout masks drawn under `pin` (the same in its recompute)."""
    if keys is None:
        return forward(x)
    with keys.pinned(*pin):
        return forward(x)


def chunked_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a chunked MLP module `self` (bound to it by `use_chunked_mlp`): its class's forward on
    `mlp_chunk` tokens of the sequence (dimension -2) at a time, each chunk checkpointed where autograd records."""
    forward = type(self).forward.__get__(self)  # the family's, over the LoRA-wrapped projections
    chunk = getattr(self, CHUNK_ATTR)
    if x.shape[-2] <= chunk:
        return forward(x)
    keys = _dropout_keys(self)
    outs = []
    for k, part in enumerate(torch.split(x, chunk, dim=-2)):
        pin = None if keys is None else (keys.step, keys.micro, k)
        if torch.is_grad_enabled():
            # No random state to restore: the MLP draws nothing from the global generators (its LoRA dropout
            # is keyed), and saving it would read the CUDA generator inside a CUDA-graph capture.
            outs.append(checkpoint(_run_chunk, forward, part, keys, pin, use_reentrant=False,
                                   preserve_rng_state=False))
        else:
            outs.append(_run_chunk(forward, part, keys, pin))
    return torch.cat(outs, dim=-2)


def use_chunked_mlp(layers: nn.ModuleList, chunk: int) -> None:
    """Make every decoder layer's MLP run `chunk` tokens at a time (`chunked_forward`).

    The forward is a method bound to the module itself, so a copy of the layer (copy.deepcopy: poros's layer
    templates) runs its own modules chunked, not the original's.
    """
    for i, layer in enumerate(layers):
        mlp = mlp_of(layer, f"layer {i}")
        setattr(mlp, CHUNK_ATTR, chunk)
        mlp.forward = types.MethodType(chunked_forward, mlp)
