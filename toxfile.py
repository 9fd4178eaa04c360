"""tox's inline plugin (tox loads a toxfile.py beside tox.ini): the `installed` env sees its stack.

The `installed` env (tox.ini) runs the stack a machine already has, through `system_site_packages`. tox builds
every env with virtualenv, and a virtualenv's system site packages are those of its base interpreter. Where the
`python3` that holds the stack is itself a virtual environment (a GPU image's interpreter often is), its packages
sit in that environment's site-packages, which the env would not see: torch, pytest and the rest would be
missing. Before the env's commands run, this puts the site-packages of the interpreter `base_python` names (as
found on PATH) on the env's PYTHONPATH, after what tox.ini sets there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from tox.plugin import impl
from tox.tox_env.api import ToxEnv

ENV = "installed"  # the env of the installed stack (tox.ini)
_SITE = "import json, site; print(json.dumps(site.getsitepackages()))"


def site_packages(python: str) -> list[str]:
    """The site-packages folders of `python` (a name on PATH or a path); [] where it cannot be run."""
    exe = shutil.which(python)
    if exe is None:
        return []
    done = subprocess.run([exe, "-c", _SITE], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return []
    return [p for p in json.loads(done.stdout) if os.path.isdir(p)]


def with_paths(pythonpath: str, extra: list[str]) -> str:
    """`pythonpath` with each of `extra` it lacks appended, in order."""
    parts = [p for p in pythonpath.split(os.pathsep) if p]
    return os.pathsep.join(parts + [p for p in extra if p not in parts])


@impl
def tox_before_run_commands(tox_env: ToxEnv) -> None:
    if tox_env.name != ENV:
        return
    extra = [p for python in tox_env.conf["base_python"] for p in site_packages(python)]
    set_env = tox_env.conf["set_env"]
    current = set_env.load("PYTHONPATH") if "PYTHONPATH" in set_env else ""
    set_env.update({"PYTHONPATH": with_paths(current, extra)})
