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

How a module runs in chunks, LoRA dropout's keys per chunk included, is poros/engine/seq_chunks.py.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from poros.engine.seq_chunks import dropout_keys, run_in_chunks
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


def chunked_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a chunked MLP module `self` (bound to it by `use_chunked_mlp`): its class's forward on
    `mlp_chunk` tokens of the sequence at a time (`run_in_chunks`)."""
    forward = type(self).forward.__get__(self)  # the family's, over the LoRA-wrapped projections
    return run_in_chunks(forward, x, getattr(self, CHUNK_ATTR), dropout_keys(self))


def use_chunked_mlp(layers: nn.ModuleList, chunk: int) -> None:
    """Make every decoder layer's MLP run `chunk` tokens at a time (`chunked_forward`).

    The forward is a method bound to the module itself, so a copy of the layer (copy.deepcopy: poros's layer
    templates) runs its own modules chunked, not the original's.
    """
    for i, layer in enumerate(layers):
        mlp = mlp_of(layer, f"layer {i}")
        setattr(mlp, CHUNK_ATTR, chunk)
        mlp.forward = types.MethodType(chunked_forward, mlp)
