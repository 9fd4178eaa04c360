"""Fixtures shared by the CPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def stores():
    """`stores(model)`: the CPU build of a tiny model with seed 0, built once per session. Tests that
    corrupt a store build their own."""
    from poros.store.build import build_store

    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = build_store(model, seed=0, device="cpu", progress=False)[0]
        return cache[model]

    return get
