"""The Hugging Face forward as the executor (poros/engine/methods/executor.py) runs it: the model's decoder layers,
embedding and lm_head patched so that one call of its forward serves either pass a micro-batch needs.

  prologue   every decoder layer is replaced by a recorder: the forward computes what the model computes
             before its layers (embeddings, rotary tables, masks) and records each layer's call arguments,
             then stops at the last layer;
  head       each layer hands on its input and the last one a leaf holding the last hidden state, so the
             final norm, lm_head and loss run exactly as in the model, with autograd, and backpropagate to
             the leaf.

Outside both (`ModelPass.PLAIN`) every layer runs the model's own forward. The embedding looks tokens up on
the host and the lm_head reads its device copy (poros/engine/runtime/buffers.py) in every pass.
"""

from __future__ import annotations

import contextlib
import enum
import functools

import torch

from poros.engine.runtime.buffers import HEAD_KEY
from poros.engine.runtime.layer_call import LayerCall
from poros.engine.model.qlora import QLoRAModel
from poros.errors import CapabilityError


@functools.cache
def _packing_check():
    """Transformers' check for packed sequences in the positions it derives (masking_utils
    .find_packed_sequence_indices), where it answers None for one position range per row: None where this version
    has no such check or it answers otherwise (a mask tensor), in which case the passes leave it as it is."""
    try:
        from transformers import masking_utils
    except ImportError:
        return None
    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None or check(torch.arange(4).unsqueeze(0)) is not None:
        return None
    return masking_utils


@contextlib.contextmanager
def _positions_unpacked():
    """Within a pass, transformers' packed-sequence check answers None without reading the device.

    The passes give the model no position_ids and no attention mask: it derives its positions from
    `cache_position`, one range per row, in which the check finds no packed sequences and answers None. It finds
    that by reading a device tensor on the host, which waits for every kernel queued before it: twice a step the
    host stopped running ahead of the device (the link idle while the host waited, experiments/h100-streamed-link-idle
    spread-12gb). The answer is the same, so are the masks and every bit the layers compute."""
    module = _packing_check()
    if module is None:
        yield
        return
    own = module.find_packed_sequence_indices
    module.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        module.find_packed_sequence_indices = own


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    """The packed-sequence check's answer for positions that are one range per row."""
    return None


class _Captured(Exception):
    """Ends a prologue once the last layer's arguments are recorded."""


class ModelPass(enum.Enum):
    """What the patched layers and embedding do during a run of the Hugging Face forward."""

    PLAIN = "plain"  # the model's own forward
    PROLOGUE = "prologue"  # layers record their call arguments; the last one ends the run
    HEAD = "head"  # layers hand on their input, the last one the leaf holding the last hidden state


class ModelHooks:
    """The executor's part that patches the model and runs its forward as a pass (a mixin of `PorosTrainer`:
    it reads the trainer's `cfg`, `device`, `store`, `buffers`, `model`, `_pass`, `_host_ids` and the step state
    `_step`)."""

    def _patch(self, model: QLoRAModel) -> None:
        """Layers record their arguments (prologue) or hand on their input (head); the embedding looks
        tokens up on the host; the lm_head reads its device copy."""
        last = len(model.layers) - 1
        for i, layer in enumerate(model.layers):
            layer.forward = self._layer_hook(i, i == last, type(layer).forward.__get__(layer))
        emb, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
        emb.to("cpu")
        emb_forward = type(emb).forward.__get__(emb)
        device, hidden = self.device, self.store.config.hidden_size
        # A plain lookup (no scale, no max_norm) gathers its rows with index_select, several times faster on
        # the host than F.embedding's bf16 path and the same bytes, into page-locked memory (the caching host
        # allocator's, reused step after step) that the device copies asynchronously.
        plain = type(emb).forward is torch.nn.Embedding.forward and emb.max_norm is None

        def embed(input_ids, *a, **k):
            if self._pass is ModelPass.HEAD:  # only its shape and dtype matter: every layer hands on its input
                return torch.empty(*input_ids.shape, hidden, dtype=torch.bfloat16, device=device)
            host = self._host_ids
            ids = host if host is not None and host.shape == input_ids.shape else input_ids.to("cpu")
            if not (plain and not a and not k):
                return emb_forward(ids, *a, **k).to(device)
            rows = torch.empty(*ids.shape, emb.embedding_dim, dtype=emb.weight.dtype, pin_memory=device.type == "cuda")
            torch.index_select(emb.weight.detach(), 0, ids.reshape(-1), out=rows.view(-1, emb.embedding_dim))
            return rows.to(device, non_blocking=True)

        emb.forward = embed
        bias = head.bias

        def head_forward(x):
            self.buffers.acquire(HEAD_KEY)
            return torch.nn.functional.linear(x, self.buffers.head, bias)

        head.forward = head_forward

    def _layer_hook(self, i: int, last: bool, original):
        def forward(*args, **kwargs):
            if self._pass is ModelPass.PLAIN:
                return original(*args, **kwargs)
            hidden, call = LayerCall.split(args, kwargs)
            step = self._step
            if self._pass is ModelPass.HEAD:
                return step.leaf if last else hidden
            if call.tensors_requiring_grad():
                raise CapabilityError(f"layer {i}: an argument other than the hidden state requires grad; "
                                      "poros recomputes layers from their input alone")
            step.calls[(i, step.micro)] = call
            if i == 0:
                step.hidden[step.micro] = hidden
            if last:
                raise _Captured
            return hidden

        return forward

    def _run_model(self, what: ModelPass, batch):
        self._pass = what
        self._host_ids = getattr(batch, "host_input_ids", None)  # the embedding's lookup reads these (Batch.to)
        try:
            # compiled layers only record or hand on here: eagerly (their compiled code is the runners')
            with (torch.compiler.set_stance("force_eager") if self.cfg.compile else contextlib.nullcontext(),
                  _positions_unpacked()):
                return self.model(input_ids=batch.input_ids, labels=batch.labels, use_cache=False)
        except _Captured:
            return None
        finally:
            self._pass, self._host_ids = ModelPass.PLAIN, None
