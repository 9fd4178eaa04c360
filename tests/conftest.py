"""Fixtures shared by the CPU tests."""

from __future__ import annotations

import gc
import os
import signal
import sys

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest -n N` without `--dist` balances by work stealing (pytest-xdist's `worksteal`): a worker that runs out
    takes queued tests from the other, so a tier of uneven tests (a few subprocess runs of a minute among many of a
    second) does not end on one worker's tail. A `--dist` given on the command line is kept."""
    if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_configure(config):
    """A worker of `pytest -n 2` (pytest-xdist) shares the cores with the other: one thread each, for torch here
    and for the processes a test starts (torch sizes its pool from OMP_NUM_THREADS). Those processes must not
    believe they are xdist workers themselves: pytest-benchmark turns itself off in a process that inherits
    PYTEST_XDIST_WORKER, and a suite run by a test would write no benchmark.json."""
    if hasattr(config, "workerinput"):
        for name in [k for k in os.environ if k.startswith("PYTEST_XDIST_")]:
            del os.environ[name]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_the_tests():
    """A test run started in the background (`pytest &`) inherits SIGINT ignored, and hands that on to every
    process it starts; the tests of Ctrl-C need Python's own handler, here and in those processes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


_freezing = True  # until a test fails


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _freezing
    if (yield).get_result().failed:
        _freezing = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test, what is still alive (modules imported, session and module fixtures) moves to gc's
    permanent generation, collected first: a trainer's close (gc.collect(), to free its memory at once) then
    walks only what the tests made since, not the few hundred thousand objects of torch, transformers and peft
    (a quarter of an eager gate's time on the CPU). Not on a CUDA machine, where a frozen cycle would hold device
    memory; not after a failure, whose traceback may hold a trainer."""
    yield
    torch = sys.modules.get("torch")
    if _freezing and not (torch is not None and torch.cuda.is_available()):
        gc.collect()
        gc.freeze()


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
