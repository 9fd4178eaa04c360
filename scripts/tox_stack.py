"""What a tox env of a stack (tox.ini: torch210, torch212) runs, once tox has installed its pins.

    python scripts/tox_stack.py OUT                  # the stack check: the parity tests, then the CPU matrix
    python scripts/tox_stack.py OUT --matrix=b300    # that matrix's cells of this stack (pytest suites/ ARGS)

OUT is a scratch folder (tox passes its env's tmp folder) for the CPU matrix's rows and report: OUT/out/results.jsonl
(the rows results/cpu/ENV/ holds). The CPU matrix is POROS_CPU_MATRIX's (tox.ini: cpu-ENV, the CPU matrix on the
env's stack; default cpu). Each command's wall time is printed when it ends.

Where torch finds a CUDA GPU it first installs the Unsloth extra (pyproject's `unsloth` requirements) under
the env's pins (not with POROS_STACK_EXTRA=0, as the `installed` env sets: it installs nothing), so that installing it cannot move torch, transformers or bitsandbytes; where the extra cannot
be installed on those pins it says so in one line and the matrix runs without it (its cells are skipped).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("torch", "transformers", "bitsandbytes")  # what a stack pins (tox.ini, a matrix's stacks)
EXTRA = "unsloth"


def extra_requirements(extra: str = EXTRA) -> list[str]:
    """The requirements poros's metadata lists under `extra`, e.g. ['unsloth>=2025.10', ...]."""
    out = []
    for req in md.requires("poros") or []:
        name, _, marker = req.partition(";")
        if marker and f'extra == "{extra}"' in marker.replace("'", '"'):
            out.append(name.strip())
    return out


def pins(versions: dict[str, str | None]) -> list[str]:
    """`pkg==version` of each pinned package installed, as its package metadata states the version (an index's
    torch 2.10.0 is `2.10.0`, whatever build it is: a `+cu128` pin would match no installed or indexed torch)."""
    return [f"{pkg}=={v}" for pkg, v in versions.items() if v]


def installed() -> dict[str, str | None]:
    """The versions of what a stack pins, as installed here (package metadata's)."""
    out = {}
    for pkg in PINNED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def install_extra_command(versions: dict[str, str | None]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", *extra_requirements(), *pins(versions)]


def commands(out: str, args: list[str], cpu_matrix: str = "cpu") -> list[list[str]]:
    """The commands of one run: with ARGS, pytest over the matrix suites; without, the stack check (the parity tests,
    then the CPU matrix `cpu_matrix`)."""
    if args:
        return [[sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "suites/", *args]]
    return [[sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/engine/test_parity.py"],
            [sys.executable, "-m", "poros", "bench", "matrix", f"matrices/{cpu_matrix}.yaml", "-o",
             str(Path(out) / "out")]]


def cuda_present() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: tox_stack.py OUT [PYTEST ARGS...] (OUT: a scratch folder, e.g. tox's {envtmpdir})", file=sys.stderr)
        return 2
    out, args = argv[0], argv[1:]
    if os.environ.get("POROS_STACK_EXTRA", "1") != "0" and cuda_present():
        versions = installed()
        done = subprocess.run(install_extra_command(versions), cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"tox_stack: the {EXTRA} extra does not install on {', '.join(pins(versions))} ({last}); "
                  f"its cells will be skipped", flush=True)
    for cmd in commands(out, args, os.environ.get("POROS_CPU_MATRIX") or "cpu"):
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        print(f"tox_stack: {' '.join(cmd[2:])}: exit {rc} after {time.monotonic() - start:.0f} s wall", flush=True)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
