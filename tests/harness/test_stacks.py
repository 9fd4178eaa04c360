"""Stack labels carry torch's build, two labels name one stack only when torch's version and build and
transformers' version agree, a pinned stack may require torch's build, and a pinned stack this process does not
run names the tox env that runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from poros.errors import ConfigError
from poros.harness import stacks
from poros.harness.matrix import load_matrix, parse_matrix
from poros.harness.stacks import Stack, running_label, same_stack, stack_id

ROOT = Path(__file__).resolve().parents[2]
T212 = "torch 2.12.0+cu130 / transformers 5.10.1"


def test_stack_id_reads_version_build_and_transformers():
    assert stack_id(T212) == ("2.12.0", "cu130", "5.10.1")
    assert stack_id("torch 2.13.0+cpu / transformers 5.24.0") == ("2.13.0", "cpu", "5.24.0")
    for label in ("torch 2.12.0 / transformers 5.10.1", "", None, float("nan"), "2.12.0+cu130"):
        assert stack_id(label) is None, label


@pytest.mark.parametrize("other, same", [
    (T212, True),
    ("torch 2.12.0+cu128 / transformers 5.10.1", False),  # another CUDA build
    ("torch 2.10.0+cu130 / transformers 5.10.1", False),
    ("torch 2.12.0+cu130 / transformers 5.5.0", False),
    ("torch 2.12.0 / transformers 5.10.1", False),  # build not stated
], ids=lambda v: str(v))
def test_same_stack(other, same):
    assert same_stack(T212, other) is same and same_stack(other, T212) is same


def test_running_label_carries_the_build_without_importing_torch():
    code = ("import sys; from poros.harness.stacks import running_label; print(running_label()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    label, imported = out.stdout.splitlines()
    import torch

    assert imported == "False"
    assert label == running_label() == f"torch {torch.__version__} / transformers {stacks._version('transformers')}"
    assert stack_id(label) is not None  # torch.__version__ says its build: +cpu, +cu130, ...


def _pinned(torch_version: str) -> Stack:
    return Stack("pinned", torch_version, stacks._version("transformers"), stacks._version("bitsandbytes"))


def test_pinned_build_must_match_the_running_torch():
    have = stacks.installed_torch()
    base, _, build = have.partition("+")
    assert _pinned(have).mismatch() is None and _pinned(base).mismatch() is None  # the accepted neighbours
    assert _pinned(have).label() == _pinned(base).label() == running_label()
    other = _pinned(f"{base}+{'cu999' if build != 'cu999' else 'cpu'}")
    why = other.mismatch()
    assert why and "build" in why and "tox -e pinned" in why
    assert other.label() == f"torch {other.torch} / transformers {other.transformers}"


BASE = {"name": "m", "steps": 1, "passes": 1, "dataset": "synthetic", "methods": ["poros", "resident"],
        "models": ["tiny-qwen2"]}


def test_matrix_stack_may_state_its_build():
    good = {"name": "t", "torch": "2.12.0+cu130", "transformers": "5.10.1", "bitsandbytes": "0.49.2"}
    (s,) = parse_matrix({**BASE, "stacks": [good]}).stacks
    assert s.torch == "2.12.0+cu130"
    with pytest.raises(ConfigError) as e:
        parse_matrix({**BASE, "stacks": [{**good, "torch": "2.12.0-cuda13"}]})
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("stacks[0].torch: expected a version")


def test_stack_mismatch_names_the_tox_env():
    """A pinned stack is either the running environment (inside its own tox env) or names that env."""
    from importlib import metadata

    m = load_matrix("b300")
    have = metadata.version("torch").split("+")[0], metadata.version("transformers")
    assert len(m.stacks) == 2
    for s in m.stacks:
        why = s.mismatch()
        if (s.torch.split("+")[0], s.transformers) == have:
            assert why is None, why
        else:
            assert why and f"tox -e {s.name}" in why, why
