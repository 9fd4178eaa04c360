"""The matrix suites' hooks and fixture (poros/suites/plugin.py), for `pytest suites/ --matrix=NAME` in a source
checkout; the options come from the checkout's root conftest.py."""

from poros.suites.plugin import *  # noqa: F401,F403
