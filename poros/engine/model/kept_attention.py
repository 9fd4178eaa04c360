"""Kept attention (`keep_attention`): a recomputed layer's recompute skips its attention's forward.

A recomputed layer runs its forward twice: once in forward, then again with autograd ahead of its backward.
The fused attention kernels (flash, memory-efficient) are deterministic in forward, so the second run computes
the very tensors the first did. Kept attention records what each fused attention call returns in the first
run (its output, log-sum-exp and the small bookkeeping tensors its backward takes) and hands those back to the
second run in place of the call: autograd, or a compiled layer's training graph, saves the same tensors for
the backward, which runs the same kernel on the same bytes as resident QLoRA's. The output and log-sum-exp
travel with the layer's saved input (on the device, or through host memory with `offload_inputs`); the plan
counts them (`attention_bytes`).

Where: a kernel of the fused attention ops at the ADInplaceOrView dispatch key, below autograd and reached by
every call of the op (eager code, and the compiled code inductor emits, which calls the op as a fallback
kernel). While no layer records or replays, it passes the call on unchanged; it is registered while a trainer
with the setting lives (`installed`). A recorded memory-efficient call asks for its log-sum-exp, as
the call with autograd does (`with_log_sumexp`). A call whose op or arguments differ from the recorded one, a
call being traced (fake tensors), a call with dropout, and a math-backend call (no fused op) are computed as
without the setting. A CUDA graph would capture the hand-back itself, so TrainConfig refuses the setting with
`cuda_graphs`.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from poros.engine.model.held import Counted

_aten = torch.ops.aten
# the fused attention ops (outputs 0 and 1 are (output, log-sum-exp) for each) and where their dropout_p is
FUSED = {
    _aten._scaled_dot_product_flash_attention.default: 3,
    _aten._scaled_dot_product_efficient_attention.default: 5,
    _aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
}
LARGE = 2  # outputs that travel with the saved input: output and log-sum-exp
_EFFICIENT = _aten._scaled_dot_product_efficient_attention.default
_LSE_ARG = 4  # memory-efficient attention's compute_log_sumexp: False in a forward without autograd
_KEY = "ADInplaceOrView"  # a key every training tensor carries, below autograd, a fallthrough for these ops
_BELOW = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _KEY))  # excluded: the call goes on to the op's kernel


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What a call must match to take a recorded result: its tensors' metadata and its other arguments."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype, a.device)
        return a

    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


@dataclass
class AttentionCall:
    """One fused attention call's op, signature and outputs (`large`: the first LARGE, kept with the saved input;
    `rest`: the others, small, kept here)."""

    op: torch._ops.OpOverload
    signature: tuple
    large: tuple
    rest: tuple

    def outputs(self) -> tuple:
        return (*self.large, *self.rest)


class AttentionRecord:
    """The fused attention calls of one layer's forward, in order."""

    def __init__(self):
        self.calls: list[AttentionCall] = []

    def large(self) -> tuple[torch.Tensor, ...]:
        """The tensors that travel with the saved input, LARGE per call in call order."""
        return tuple(t for c in self.calls for t in c.large)

    def with_large(self, tensors) -> "AttentionRecord":
        """This record holding `tensors` as its large ones (`()`: none, while they are saved elsewhere)."""
        out, tensors = AttentionRecord(), tuple(tensors)
        for i, c in enumerate(self.calls):
            out.calls.append(AttentionCall(c.op, c.signature, tensors[i * LARGE:(i + 1) * LARGE], c.rest))
        return out


class _Active:
    """What this thread's fused attention calls do now: append to `record`, or take from `pending`."""

    def __init__(self, record: AttentionRecord | None = None, pending: list | None = None):
        self.record, self.pending = record, pending
        self.counts = {"replayed": 0, "computed": 0}


_state = threading.local()


def _recordable(op, args, kwargs) -> bool:
    """A call on real tensors (not one being traced) without dropout (dropout draws its mask per call)."""
    at = FUSED[op]
    dropout = kwargs.get("dropout_p", args[at] if len(args) > at else 0.0)
    return type(args[0]) is torch.Tensor and not dropout


def with_log_sumexp(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call as autograd makes it: memory-efficient attention called without autograd skips its log-sum-exp,
    which the recompute's backward needs, so a recorded call asks for it (the output is the same tensor the
    call with autograd, resident's, computes)."""
    if op is not _EFFICIENT:
        return args, kwargs
    if len(args) > _LSE_ARG:
        return (*args[:_LSE_ARG], True, *args[_LSE_ARG + 1:]), kwargs
    return args, {**kwargs, "compute_log_sumexp": True}


def _kernel(op):
    def kernel(*args, **kwargs):
        active = getattr(_state, "active", None)
        kept = active is not None and _recordable(op, args, kwargs)
        if kept and active.pending is not None:
            if active.pending:
                call = active.pending.pop(0)
                if call.op is op and call.signature == _signature(args, kwargs):
                    active.counts["replayed"] += 1
                    return call.outputs()
                active.pending.clear()  # out of step with the record: every later call computes
            active.counts["computed"] += 1
        records = kept and active.record is not None
        if records:
            args, kwargs = with_log_sumexp(op, args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_BELOW):
            out = op(*args, **kwargs)
        if records:
            active.record.calls.append(AttentionCall(op, _signature(args, kwargs), tuple(out[:LARGE]),
                                                     tuple(out[LARGE:])))
        return out

    return kernel


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    for op in FUSED:
        library.impl(op._schema.name.removeprefix("aten::"), _kernel(op), _KEY)
    return library


_kernels = Counted(_register, lambda library: library._destroy())


def installed():
    """The kernels registered for as long as this is entered (by any number of holders at once)."""
    return _kernels.held()


@contextlib.contextmanager
def _active(state: _Active):
    if _kernels.holders == 0:
        raise RuntimeError("kept attention records and replays only while its kernels are installed")
    before = getattr(_state, "active", None)
    _state.active = state
    try:
        yield state
    finally:
        _state.active = before


@contextlib.contextmanager
def recording():
    """Record every fused attention call this thread makes inside: yields the `AttentionRecord` it fills."""
    record = AttentionRecord()
    with _active(_Active(record=record)):
        yield record


@contextlib.contextmanager
def replaying(record: AttentionRecord):
    """This thread's fused attention calls inside take `record`'s results in order, where op and arguments
    match; yields a dict counting the `replayed` and `computed` calls."""
    with _active(_Active(pending=list(record.calls))) as state:
        yield state.counts
