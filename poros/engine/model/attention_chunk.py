"""The chunked attention block (`attention_chunk`): a decoder layer's token-wise modules outside its MLP on
`attention_chunk` tokens of the sequence at a time.

Only the attention core (SDPA over the whole sequence) mixes tokens. Around it every module computes each token
on its own: the attention's q, k, v and o projections (their peft LoRA layers included) and the layer's norms
(the input and post-attention layernorms, and Gemma's pre- and post-feedforward ones). Each of these modules runs
its own forward on one chunk of the sequence at a time, each chunk under non-reentrant checkpointing, and the
outputs are concatenated along the sequence, so the tensors the module saves for its backward are one chunk's at a
time (recomputed just before each chunk's backward) and never the whole sequence's: the norms' float32 copies of
their inputs, and the LoRA layers' copies of their inputs in the adapters' dtype (float32 with `lora_compute:
fp32`) and rank-wide products. What stays whole is what the modules hand each other (each module's output, which
the next saves as its checkpoint's input) and the attention core's own tensors. The family's attention and layer
forwards are not touched: only the modules they call are chunked, so any family works alike. The attention's
per-head norms (q_norm, k_norm) run on per-head views whose sequence dimension differs between families and
are left whole, as are the rotary embeddings (they save only the per-position cos and sin).

The modules' matmuls then run on fewer rows and the LoRA weight gradients are summed chunk by chunk, so the bits
differ from the unchunked block's: a setting of what is computed, shared by every method of a run, which runs the
same chunks through the same kernels whether its layer runs eagerly, recomputed, compiled or from a layer
template (as `mlp_chunk`, whose chunked run and keyed LoRA dropout it shares: poros/engine/model/seq_chunks.py).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from poros.engine.model.seq_chunks import dropout_keys, run_in_chunks
from poros.errors import ConfigError

CHUNK_ATTR = "attention_chunk"  # tokens per chunk, on each chunked module (a layer template's copy keeps it)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # of the layer's `self_attn`, where present
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def chunked_modules(layer: nn.Module, where: str) -> list[nn.Module]:
    """A decoder layer's token-wise modules outside its MLP: its attention's projections and its norms (those
    the family has: a Gemma 4 layer that shares another's keys has no k_proj, one with k_eq_v no v_proj).

    Raises:
        ConfigError: the layer has no `self_attn` module or it has no q_proj, naming the layer's class.
    """
    attn = getattr(layer, "self_attn", None)
    if not isinstance(attn, nn.Module) or not isinstance(getattr(attn, "q_proj", None), nn.Module):
        raise ConfigError([f"attention_chunk: chunks the projections of a decoder layer's `self_attn` module, and "
                           f"{where} ({type(layer).__name__}) has none; drop attention_chunk for this model"],
                          source="TrainConfig")
    projections = [getattr(attn, n, None) for n in PROJECTIONS]
    norms = [getattr(layer, n, None) for n in NORMS]
    return [m for m in projections + norms if isinstance(m, nn.Module)]


def chunked_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a chunked module `self` (bound to it by `use_chunked_attention`): its class's forward on
    `attention_chunk` tokens of the sequence at a time (`run_in_chunks`)."""
    forward = type(self).forward.__get__(self)  # the module's own: peft's LoRA layer, a family's norm
    if args or kwargs:
        forward = _with_arguments(forward, args, kwargs)
    return run_in_chunks(forward, x, getattr(self, CHUNK_ATTR), dropout_keys(self))


def _with_arguments(forward, args: tuple, kwargs: dict):
    """`forward` with the call's other arguments (none in the families' calls; passed on as they came)."""
    return lambda x: forward(x, *args, **kwargs)


def use_chunked_attention(layers: nn.ModuleList, chunk: int) -> None:
    """Make every decoder layer's token-wise modules outside its MLP run `chunk` tokens at a time
    (`chunked_forward`). Called on the LoRA-wrapped model: a projection's chunk holds its LoRA layer.

    The forward is a method bound to the module itself, so a copy of the layer (copy.deepcopy: poros's layer
    templates) runs its own modules chunked, not the original's.
    """
    for i, layer in enumerate(layers):
        for module in chunked_modules(layer, f"layer {i}"):
            setattr(module, CHUNK_ATTR, chunk)
            module.forward = types.MethodType(chunked_forward, module)
