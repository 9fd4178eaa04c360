"""The matrix suites: per model × stack × sweep point the parity gate, then per method the timed passes
(`test_matrix.py`), and the pytest plugin that parametrizes them from a matrix file (`plugin.py`). They ship in
the package: `poros bench matrix` runs them wherever Poros is installed."""
