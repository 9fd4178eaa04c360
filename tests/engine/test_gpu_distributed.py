"""Data parallelism on two GPUs (NCCL): the checks of tests/engine/test_distributed.py, on CUDA, with pinned
shared stores.

    pytest -m gpu tests/engine/test_gpu_distributed.py
"""

from __future__ import annotations

import pytest

from tests.capabilities import requires_gpu
from tests.engine.test_distributed import check_two_ranks, launch


@pytest.mark.gpu
@requires_gpu(2)
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma3"])
def test_gpu_two_ranks(model, tmp_path):
    report = launch(tmp_path / "ranks.json", model, "cuda")
    print(report["gate"])
    check_two_ranks(report)
    assert report["pinned"]  # each rank page-locked the shared arena for its own GPU
