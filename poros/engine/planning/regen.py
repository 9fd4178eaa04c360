"""Strided saved inputs (`input_stride`): which recomputed layers save no input, and the operations that
regenerate those inputs in backward.

A layer whose input is regenerated (`Plan.regenerated`) saves nothing in forward; before the backward of the
top layer of its segment (a saved layer L and the regenerated layers L+1..top after it), `regenerate` operations
run the forwards of layers L..top-1 again without grad, each from the input before it (L's saved one first),
and hold the inputs they produce on the device until their layers' backwards take them. They run the very
forwards the forward pass ran (the layer's runner's no-grad forward, with its recorded call and dropout keys),
so the regenerated inputs are the forward pass's bits.

Placement: along each run of consecutive recomputed layers, a segment starts at the run's first layer and
holds up to `input_stride` layers, but only as far as the weights of its layers L..top-1 are on the device at
every backward of its top layer: already loaded for that backward (its own group, a resident one, or the
streamed group prefetched behind it). A regeneration thus loads no weights and copies no byte more per step; what
it costs is layer forwards. With block size 1 and two rotating buffers that allows segments of two layers (the
layer below is the one prefetched); larger blocks allow up to block size + 1. A segment that reached no further
starts a new saved input: `Plan.input_stride` is what was asked, `regenerated` what the weights allowed.

`regenerated_layers` bounds how many (`thin`): each regenerated input saves its bytes (in host memory or on the
device) and costs a layer forward a step, so a plan regenerates no more inputs than its budgets need (`auto`: the
fewest that fit them, poros/engine/planning/budget.py).
"""

from __future__ import annotations

from poros.engine.planning.plan import BACKWARD, HEAD_SLOT, LOAD, LOAD_HEAD, REGEN, Group, Op


def present_at_backwards(setup: list[Op], step: list[Op]) -> dict[tuple[int, int], frozenset[int]]:
    """(layer, micro-batch) -> the groups in their buffers at that backward (after every load before it)."""
    holds: dict[int, int] = {}
    for op in setup:
        if op.kind == LOAD:
            holds[op.buffer] = op.group
    out = {}
    for op in step:
        if op.kind in (LOAD, LOAD_HEAD):
            holds[op.buffer] = op.group if op.kind == LOAD else HEAD_SLOT
        elif op.kind == BACKWARD:
            out[(op.layer, op.micro)] = frozenset(holds.values())
    return out


def segments(recomputed: list[int], stride: int, group_of: dict[int, Group],
             present: dict[tuple[int, int], frozenset[int]], micros: int) -> list[list[int]]:
    """The recomputed layers in segments (module docstring): each a saved layer and the regenerated ones above it."""
    out: list[list[int]] = []
    for i in recomputed:
        seg = out[-1] if out else None
        grows = (seg is not None and i == seg[-1] + 1 and len(seg) < stride
                 and all(group_of[j].index in present[(i, m)] for m in range(micros) for j in seg))
        if grows:
            seg.append(i)
        else:
            out.append([i])
    return out


def thin(segs: list[list[int]], keep: int | None) -> list[list[int]]:
    """`segs` with at most `keep` regenerated layers (None: all), spread evenly over the regenerated layers in
    order: each one dropped saves its input instead and starts a segment of the layers above it in its old one,
    whose weights that segment's top backward finds on the device as the old segment's did."""
    regenerated = [i for seg in segs for i in seg[1:]]
    if keep is None or keep >= len(regenerated):
        return segs
    kept = {regenerated[j * len(regenerated) // keep] for j in range(keep)}
    out: list[list[int]] = []
    for seg in segs:
        out.append([seg[0]])
        for i in seg[1:]:
            if i in kept:
                out[-1].append(i)
            else:
                out.append([i])
    return out


def regen_ops(step: list[Op], segs: list[list[int]], group_of: dict[int, Group]) -> list[Op]:
    """`step` with each segment's regenerations right before its top layer's backward of each micro-batch:
    the forwards of its layers but the top, ascending."""
    below = {seg[-1]: seg[:-1] for seg in segs if len(seg) > 1}
    out: list[Op] = []
    for op in step:
        if op.kind == BACKWARD and op.layer in below:
            out += [Op(REGEN, layer=j, micro=op.micro, group=group_of[j].index) for j in below[op.layer]]
        out.append(op)
    return out


def alive_at_once(segs: list[list[int]], live: int) -> int:
    """Regenerated inputs on the device at once, at most: a segment's (all its layers' but the saved one), for each
    micro-batch kept at once (layer-major: each micro-batch's are regenerated before its top layer's backward)."""
    return max((len(s) - 1 for s in segs), default=0) * live
