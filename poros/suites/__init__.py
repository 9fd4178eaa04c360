"""The matrix suites: per model × stack × sweep point the parity gate, then per method the timed passes
(`test_matrix.py`), and the pytest plugin that parametrizes them from a matrix file (`plugin.py`; a run's state
in `session.py`, its pytest-benchmark record in `benchmarks.py`). They ship in the package: `poros bench
matrix` runs them wherever Poros is installed."""

OUT_OF_TIME = 75  # exit status of a run stopped by --max-minutes with cells left (EX_TEMPFAIL: run it again)
WRITE_FAILED = 74  # exit status of a run stopped where a record could not be written (EX_IOERR: make room, --resume)
