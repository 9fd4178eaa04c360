"""The matrix suites' options (poros/suites/plugin.py) for `pytest suites/` in a source checkout: pytest reads
options from the conftest files at its root."""

from poros.suites.plugin import pytest_addoption  # noqa: F401
