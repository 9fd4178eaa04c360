"""The executor's step (poros/engine/methods/executor.py): an interpreter of the plan's operations over one optimizer
step's micro-batches.

  load, release       a group's NF4 bytes into its buffer, and the point after which the buffer may be
                      refilled (poros/engine/runtime/buffers.py: the copies and the events that order them);
  gather              with copies shared among data-parallel ranks (shard_stream), the other ranks'
                      shares of the load before, all-gathered into the buffer;
  offload, fetch      a saved input the plan keeps in host memory, out after its forward and back ahead of its
                      backward (poros/engine/runtime/saved_inputs.py);
  regenerate          with `input_stride`, a layer's no-grad forward again in backward, from its input: the
                      input of the layer above, which saved none (poros/engine/planning/regen.py);
  forward, backward   a layer, by the runner of its kind (poros/engine/runtime/runners.py: recomputed or kept,
                      eagerly or through layer templates replayed from CUDA graphs); the first layer's forward
                      of a micro-batch runs its prologue first (poros/engine/runtime/model_hooks.py);
  head                the Hugging Face forward again as the head pass (poros/engine/runtime/model_hooks.py): the final
                      norm, lm_head and loss, backpropagated to the last hidden state.

A backward is pending until the next one needs its gradient: with `overlap_backward` a worker thread
enqueues it while this thread enqueues the next layer's recompute (the same kernels on the same stream;
the host-side launch work overlaps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from poros.engine.model.attention import sdpa_context
from poros.engine.runtime.buffers import HEAD_KEY
from poros.engine.runtime.layer_call import LayerCall
from poros.engine.runtime.model_hooks import ModelPass
from poros.engine.planning import plan as P
from poros.engine.runtime.runners import Done, Key
from poros.errors import CapabilityError


@dataclass
class _Step:
    """The state of one optimizer step's operations, dropped when the step ends."""

    batches: list
    losses: list
    micro: int = 0  # the micro-batch the prologue records
    calls: dict[Key, LayerCall] = field(default_factory=dict)  # recorded by the prologue, taken by the forward
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> hidden state between layers
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # micro-batch -> gradient at a layer's output
    leaf: torch.Tensor | None = None  # the head's last hidden state
    pending: tuple | None = None  # (pending gradient, micro-batch, layer, backward count) in flight
    backwards: int = 0


class PlanInterpreter:
    """The executor's part that runs a step's operations (a mixin of `PorosTrainer`: it reads the trainer's
    `plan`, `cfg`, `buffers`, `saved`, `runners`, `reducer` and `_layer_final`, counts `_regenerations`, and
    runs the model's passes with `_run_model`)."""

    def accumulate(self, batches) -> list[torch.Tensor]:
        """Run the plan's step over `batches` (its grad_accum micro-batches): the scaled loss of each,
        LoRA gradients accumulated as resident QLoRA accumulates them."""
        if len(batches) != self.plan.grad_accum:
            raise CapabilityError(f"the plan is for {self.plan.grad_accum} micro-batches, got {len(batches)}")
        step = self._step = _Step(batches, [None] * len(batches))
        handlers = {P.LOAD: self.buffers.load, P.LOAD_HEAD: self.buffers.load_head, P.RELEASE: self._release,
                    P.RELEASE_HEAD: self._release, P.FORWARD: self._forward, P.HEAD: self._head,
                    P.BACKWARD: self._backward, P.GATHER: self.buffers.gather,
                    P.GATHER_HEAD: self.buffers.gather_head,
                    P.OFFLOAD: lambda op: self.saved.offload((op.layer, op.micro), op.buffer),
                    P.FETCH: lambda op: self.saved.fetch((op.layer, op.micro)), P.REGEN: self._regenerate}
        with sdpa_context(self.cfg.attention):
            for op in self.plan.step:
                handlers[op.kind](op)
            self._resolve()
        if self.reducer is not None:
            self.reducer.finish()
        self._step = None
        assert not len(self.saved) and not step.calls and not any(len(r) for r in self.runners), \
            "every saved input and kept activation is consumed by its backward"
        return step.losses

    def _resolve(self) -> None:
        """Wait for the backward in flight (its kernels enqueued) and take the gradient it produced; after
        a layer's last backward its gradients are whole (the reducer's cue)."""
        step = self._step
        if step.pending is not None:
            pending, m, i, k = step.pending
            step.pending = None
            step.grads[m] = pending.result()
            if self.reducer is not None and k in self._layer_final:
                self.reducer.layer_done(i)

    def _release(self, op: P.Op) -> None:
        self._resolve()  # the free event must follow every kernel that reads the buffer
        self.buffers.release(op.buffer if op.kind == P.RELEASE else (HEAD_KEY if op.buffer < 0 else op.buffer))
        if op.kind == P.RELEASE_HEAD and op.buffer >= 0:
            self.buffers.release(HEAD_KEY)

    def _forward(self, op: P.Op) -> None:
        i, m, step = op.layer, op.micro, self._step
        self.dropout_micro(m, len(step.batches))  # a recompute draws its forward's LoRA dropout masks
        if i == 0:
            step.micro = m
            self._run_model(ModelPass.PROLOGUE, step.batches[m])
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        step.hidden[m] = self.runners[i].forward((i, m), step.hidden[m], step.calls.pop((i, m)))

    def _regenerate(self, op: P.Op) -> None:
        j, m = op.layer, op.micro
        self.dropout_micro(m, len(self._step.batches))  # the masks the forward drew
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        self.saved.put((j + 1, m), self.runners[j].regenerate((j, m)))
        self._regenerations += 1

    def _head(self, op: P.Op) -> None:
        m, step = op.micro, self._step
        if not self.plan.head_resident:
            self.buffers.acquire(HEAD_KEY)
        step.leaf = step.hidden.pop(m).detach().requires_grad_(True)
        out = self._run_model(ModelPass.HEAD, step.batches[m])
        loss = out.loss / self.cfg.grad_accum
        loss.backward()
        step.grads[m] = step.leaf.grad
        step.leaf = None
        step.losses[m] = loss.detach()

    def _backward(self, op: P.Op) -> None:
        i, m, step = op.layer, op.micro, self._step
        self.dropout_micro(m, len(step.batches))
        self.buffers.acquire(self.plan.groups[op.group].buffer)
        k = step.backwards = step.backwards + 1

        def grad() -> torch.Tensor:  # the gradient at this layer's output, once the backward before is done
            self._resolve()
            return step.grads.pop(m)

        step.pending = (self.runners[i].backward((i, m), grad), m, i, k)
        if isinstance(step.pending[0], Done):  # computed already (serially, or by a template)
            self._resolve()
