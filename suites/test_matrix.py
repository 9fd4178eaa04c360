"""The matrix suites as the package ships them (poros/suites/test_matrix.py), collected here so that
`pytest suites/ --matrix=NAME` runs them from a source checkout under the same cell ids as `poros bench`.

Run: pytest suites/ --matrix=cpu   (or b300, a100, h200, a path; --steps/--passes for quick runs)
"""

from poros.suites.test_matrix import pytestmark, test_parity, test_step  # noqa: F401
