"""Fixtures shared by the CPU tests."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_the_tests():
    """A test run started in the background (`pytest &`) inherits SIGINT ignored, and hands that on to every
    process it starts; the tests of Ctrl-C need Python's own handler, here and in those processes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


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
