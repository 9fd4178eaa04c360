"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture
def fresh_compile_caches():
    """The test compiles from scratch: compiled code from another test's layers must not be reused; on a GPU
    the memory the dropped compiled layers held goes back to the device."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
