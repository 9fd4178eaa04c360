"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import gc

import pytest
import torch

from poros.engine.planning.geometry import Geometry
from poros.models.checkpoint import resolve
from poros.settings import LORA_TARGETS


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


@pytest.fixture(scope="session")
def q72() -> Geometry:
    """qwen2.5-72b's geometry (from its shapes: no weights), with LoRA on every linear layer."""
    return Geometry.of_config("qwen2.5-72b", resolve("qwen2.5-72b").config, LORA_TARGETS)
