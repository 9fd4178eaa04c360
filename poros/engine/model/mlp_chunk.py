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

In poros's recompute of an eager layer before its backward, the layer's output is only backpropagated. Where the
MLP's output feeds the residual add alone (`RESIDUAL_MLP_LAYERS`: qwen2, qwen3), the chunked MLP there computes
nothing in its forward and each chunk's forward and backward in its backward (`output_only_backpropagated`,
`seq_chunks.deferred_in_chunks`): each chunk runs twice a step, not three times (the forward, the recompute, its
checkpoint's recompute), with the checkpointed chunks' bits. A compiled layer's MLP runs in the graph resident's
forward runs, three times a step; with `compile_mlp` off it runs eager between the layer's compiled parts
(poros/engine/model/compiling.py `keep_mlp_eager`) and is deferred as an eager layer's.

How a module runs in chunks, LoRA dropout's keys per chunk included, is poros/engine/model/seq_chunks.py.
"""

from __future__ import annotations

import contextlib
import threading
import types

import torch
from torch import nn

from poros.engine.model.seq_chunks import deferred_in_chunks, dropout_keys, run_in_chunks
from poros.errors import ConfigError

CHUNK_ATTR = "mlp_chunk"  # tokens per chunk, on each chunked MLP module (a layer template's copy keeps it)
DEFERRABLE_ATTR = "mlp_chunk_deferrable"  # on each chunked MLP module: its layer is in RESIDUAL_MLP_LAYERS
# Decoder layers whose MLP output feeds the residual add alone (`hidden = residual + mlp(norm(hidden))`), so the
# backward reads nothing of its value and `output_only_backpropagated` may leave it uncomputed. Declared, not
# discovered: a family whose layer reads it (gemma's post-feedforward norm) is absent.
RESIDUAL_MLP_LAYERS = frozenset({"Qwen2DecoderLayer", "Qwen3DecoderLayer"})
_thread = threading.local()  # `deferred`: inside output_only_backpropagated on this thread


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


@contextlib.contextmanager
def output_only_backpropagated():
    """While it lasts, on this thread, the chunked MLP of a layer in `RESIDUAL_MLP_LAYERS` computes no output
    until its backward (`seq_chunks.deferred_in_chunks`): for a layer call whose output nothing reads but
    autograd, poros's recompute of a layer before its backward. Each chunk then runs its forward once in the
    backward instead of twice (the recompute's, and its checkpoint's again), with the same bits."""
    before = getattr(_thread, "deferred", False)
    _thread.deferred = True
    try:
        yield
    finally:
        _thread.deferred = before


def chunked_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The forward of a chunked MLP module `self` (bound to it by `use_chunked_mlp`): its class's forward on
    `mlp_chunk` tokens of the sequence at a time (`run_in_chunks`; `deferred_in_chunks` under
    `output_only_backpropagated` where its layer allows it)."""
    forward = type(self).forward.__get__(self)  # the family's, over the LoRA-wrapped projections
    chunk, keys = getattr(self, CHUNK_ATTR), dropout_keys(self)
    if getattr(_thread, "deferred", False) and getattr(self, DEFERRABLE_ATTR, False):
        return deferred_in_chunks(forward, x, chunk, keys, [p for p in self.parameters() if p.requires_grad])
    return run_in_chunks(forward, x, chunk, keys)


def use_chunked_mlp(layers: nn.ModuleList, chunk: int) -> None:
    """Make every decoder layer's MLP run `chunk` tokens at a time (`chunked_forward`).

    The forward is a method bound to the module itself, so a copy of the layer (copy.deepcopy: poros's layer
    templates) runs its own modules chunked, not the original's.
    """
    for i, layer in enumerate(layers):
        mlp = mlp_of(layer, f"layer {i}")
        setattr(mlp, CHUNK_ATTR, chunk)
        setattr(mlp, DEFERRABLE_ATTR, type(layer).__name__ in RESIDUAL_MLP_LAYERS)
        mlp.forward = types.MethodType(chunked_forward, mlp)
