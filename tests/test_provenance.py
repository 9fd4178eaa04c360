"""Which GPUs a row names: NVML lists every GPU of the machine, the row names the ones its process saw."""

from __future__ import annotations

import pytest

from poros.provenance import visible

GPUS = [{"index": i, "uuid": f"GPU-{c}{c}{c}-0000", "name": "NVIDIA H200"} for i, c in enumerate("abc")]


@pytest.mark.parametrize("spec,indices", [
    (None, [0, 1, 2]),       # not set: every GPU
    ("1", [1]),              # the second GPU alone: it is the row's first
    ("2,0", [2, 0]),         # CUDA's order, not NVML's
    ("GPU-bbb", [1]),        # a UUID prefix
    ("0,7,2", [0]),          # an entry that matches nothing ends the list, as for CUDA
    ("", []),                # set but empty: no GPU
])
def test_visible_gpus_in_cuda_order(spec, indices):
    assert [g["index"] for g in visible(GPUS, spec)] == indices
