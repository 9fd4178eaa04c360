"""Parametrize the matrix suites from `--matrix`; cells run model by model, parity first."""

from __future__ import annotations

from pathlib import Path

import pytest

from poros.bench import ResultsWriter, StoreCache, matrix_cells, matrix_device, set_progress_writer
from poros.matrix import load_matrix


def _matrix(config):
    m = load_matrix(config.getoption("--matrix"))
    reduced = m.with_overrides(config.getoption("--steps"), config.getoption("--passes"))
    return m, reduced


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options
def pytest_configure(config):
    if getattr(config.option, "benchmark_json", "absent") is None:  # keep its JSON beside the results
        config.option.benchmark_json = Path(config.getoption("--results")).with_name("benchmark.json")
        config.option.benchmark_json.parent.mkdir(parents=True, exist_ok=True)


def pytest_sessionstart(session):
    config = session.config
    if _matrix(config)[1].deterministic:
        # first, before any CUDA work: cuBLAS reads its workspace configuration once per process
        from poros.train import enable_determinism

        enable_determinism()
    tw = config.get_terminal_writer()
    capman = config.pluginmanager.getplugin("capturemanager")

    def line(msg: str) -> None:
        if capman is None:
            tw.line(msg)
        else:
            with capman.global_and_fixture_disabled():  # fd-level capture would swallow it
                tw.line(msg)
        tw.flush()

    set_progress_writer(line)


def pytest_generate_tests(metafunc):
    if "cell" not in metafunc.fixturenames:
        return
    _, m = _matrix(metafunc.config)
    gate = metafunc.function.__name__ == "test_parity"
    cells = [c for c in matrix_cells(m) if (c.method is None) == gate]
    metafunc.parametrize("cell", cells, ids=[c.id for c in cells])


def pytest_collection_modifyitems(config, items):
    cells = [c.key for c in matrix_cells(_matrix(config)[1])]
    order = {k: i for i, k in enumerate(cells)}

    def key(item):
        cell = getattr(item, "callspec", None) and item.callspec.params.get("cell")
        return order.get(cell.key, len(order)) if cell else -1

    items.sort(key=key)


def pytest_collection_finish(session):
    session.config._poros_cells = sum(1 for item in session.items if "cell" in getattr(item, "fixturenames", ()))


class Session:
    """State shared by the cells of one run: matrix, results file, store cache, gate outcomes."""

    def __init__(self, config):
        self.full, self.matrix = _matrix(config)
        self.reduced = (self.matrix.steps, self.matrix.passes) != (self.full.steps, self.full.passes)
        self.parity_steps = config.getoption("--parity-steps") or self.matrix.parity_steps
        self.writer = ResultsWriter(config.getoption("--results"))
        self.resume = config.getoption("--resume")
        self.device = matrix_device(self.matrix)
        self.stores = StoreCache(self.device)
        self.gates: dict[tuple, object] = {}
        self.total = getattr(config, "_poros_cells", None) or len(matrix_cells(self.matrix))
        self.index = 0


@pytest.fixture(scope="session")
def session(request):
    return Session(request.config)
