"""Which GPUs a row names: NVML lists every GPU of the machine, the row names the ones its process saw."""

from __future__ import annotations

import pytest

from poros.provenance import is_hardware, visible

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


@pytest.mark.parametrize("declared,gpu", [
    ("A100-80GB-PCIe", "NVIDIA A100 80GB PCIe"),   # the reference's label, NVML's name
    ("B300", "NVIDIA B300 SXM6 AC"),
    ("NVIDIA B300 SXM6", "NVIDIA B300 SXM6 AC"),   # matrices/b300.yaml's hardware
    ("NVIDIA H200", "NVIDIA H200"),
    ("h200", "NVIDIA H200 NVL"),
])
def test_a_declared_name_is_the_gpu_it_names(declared, gpu):
    assert is_hardware(declared, gpu)


@pytest.mark.parametrize("declared,gpu", [
    ("B300", "NVIDIA GB300"),                      # a word, not a part of one
    ("A100-80GB-PCIe", "NVIDIA A100-SXM4-80GB"),   # another A100
    ("A100-80GB-PCIe", "NVIDIA A100 80GB"),        # the form is part of the name
    ("B300", "NVIDIA H200"),
    ("", "NVIDIA H200"),                           # an empty name declares nothing
])
def test_a_declared_name_is_not_another_gpu(declared, gpu):
    """Negative control of the above: the words of the declared name must all be the GPU's."""
    assert not is_hardware(declared, gpu)
