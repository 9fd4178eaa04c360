"""Capability gates, declared once and used by tests and suites alike."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpu(n: int = 1):
    found = cuda_count()
    return pytest.mark.skipif(found < n, reason=f"requires {n} CUDA GPU{'s' if n > 1 else ''}, found {found}")


def requires_module(name: str):
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"requires {name}, not installed")


requires_bitsandbytes = requires_module("bitsandbytes")
requires_datasets = requires_module("datasets")  # the `data` extra: pip install -e '.[data]'
