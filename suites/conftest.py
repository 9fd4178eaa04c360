"""Parametrize the matrix suites from `--matrix`; cells run model by model, parity first."""

from __future__ import annotations

import pytest

from poros.bench import ResultsWriter, StoreCache, matrix_cells, matrix_device, set_progress_writer
from poros.matrix import load_matrix


def _matrix(config):
    m = load_matrix(config.getoption("--matrix"))
    reduced = m.with_overrides(config.getoption("--steps"), config.getoption("--passes"))
    return m, reduced


def pytest_configure(config):
    set_progress_writer(config.get_terminal_writer())


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
        self.total = len(matrix_cells(self.matrix))
        self.index = 0


@pytest.fixture(scope="session")
def session(request):
    return Session(request.config)
