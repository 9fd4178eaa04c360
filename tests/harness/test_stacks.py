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


@pytest.mark.parametrize("version, cuda, hip, build", [
    ("2.10.0", "12.8", None, "cu128"),         # an index's CUDA build whose version states no build
    ("2.10.0+cu128", "12.8", None, "cu128"),   # PyPI's default Linux wheel
    ("2.12.0", "13.0", None, "cu130"),
    ("2.13.0+cpu", None, None, "cpu"),
    ("2.13.0", None, None, "cpu"),             # a build for no GPU
    ("2.9.0+rocm6.4", None, "6.4.43484", "rocm6.4"),
], ids=lambda v: str(v))
def test_torch_build_is_read_from_torch_version_cuda(version, cuda, hip, build):
    assert stacks.torch_build(version, cuda, hip) == build


def _fake_torch(tmp_path, monkeypatch, version: str, cuda: str | None) -> None:
    """An installed torch (as find_spec finds it) whose torch/version.py says `version` and `cuda`."""
    import importlib.machinery

    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "version.py").write_text(f"from typing import Optional\n\n__all__ = ['__version__']\n"
                                       f"__version__ = '{version}'\ndebug = False\n"
                                       f"cuda: Optional[str] = {cuda and repr(cuda)}\nhip: Optional[str] = None\n")
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(stacks.importlib.util, "find_spec", lambda name: spec if name == "torch" else None)


def test_a_cuda_build_without_a_suffix_runs_its_pinned_stack(tmp_path, monkeypatch):
    """torch 2.10.0 as an index serves it, built for CUDA 12.8 with no `+cu128` in its version: the stack pinned as
    2.10.0+cu128 runs here, and its label names the build; the control, the same version built for CUDA 12.6, is
    refused, naming the build and the env."""
    _fake_torch(tmp_path, monkeypatch, "2.10.0", "12.8")
    assert stacks.installed_torch() == "2.10.0+cu128"
    s = Stack("torch210", "2.10.0+cu128", stacks._version("transformers"), stacks._version("bitsandbytes"))
    assert s.mismatch() is None and s.label().startswith("torch 2.10.0+cu128 / ")
    other = Stack("torch210", "2.10.0+cu126", s.transformers, s.bitsandbytes)
    assert "build cu126" in other.mismatch() and "tox -e torch210" in other.mismatch()
