"""Faults made on purpose for negative controls (CPU tests and the GPU gate): plans that break a rule, and a
kept tensor changed."""

from __future__ import annotations

from dataclasses import replace

from poros.engine.planning import plan as P


def refill_before_backward(plan: P.Plan) -> P.Plan:
    """The bitsandbytes trap as a plan: just before the backward of the first streamed group that shares
    its buffer with another group, that other group's (valid) NF4 bytes are loaded over it."""
    ops = list(plan.step)
    for pos, op in enumerate(ops):
        if op.kind != P.BACKWARD:
            continue
        g = plan.groups[op.group]
        other = next((h for h in plan.groups if h.buffer == g.buffer and h.index != g.index
                      and h.nbytes <= plan.buffers[g.buffer].nbytes), None)
        if not g.resident and other is not None:
            ops.insert(pos, P.Op(P.LOAD, group=other.index, buffer=g.buffer))
            return replace(plan, step=tuple(ops))
    raise ValueError("no streamed group shares a buffer: use more layers than two blocks")


def reverse_micro_batches_in_backward(plan: P.Plan) -> P.Plan:
    """Each layer's micro-batch backwards in reverse order: LoRA gradients summed in another order."""
    ops = list(plan.step)
    i = 0
    while i < len(ops):
        if ops[i].kind == P.BACKWARD:
            j = i
            while j < len(ops) and ops[j].kind == P.BACKWARD and ops[j].layer == ops[i].layer:
                j += 1
            ops[i:j] = reversed(ops[i:j])
            i = j
        else:
            i += 1
    return replace(plan, step=tuple(ops))


def change_kept_attention_output(monkeypatch) -> None:
    """From now on (for the test), every recompute takes a kept attention output with one value changed."""
    from poros.engine.model import kept_attention

    real = kept_attention.AttentionRecord.with_large

    def with_large(self, tensors):
        tensors = tuple(tensors)
        if tensors:
            out = tensors[0].clone()
            out[0, 0, 0, 3] += 1
            tensors = (out, *tensors[1:])
        return real(self, tensors)

    monkeypatch.setattr(kept_attention.AttentionRecord, "with_large", with_large)
