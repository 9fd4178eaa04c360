"""tox.ini: each env pins the stack a matrix pins under its name (torch with its CUDA build), installs it from
the index of that build, and runs scripts/tox_stack.py: the stack check, or a matrix's cells with ARGS."""

from __future__ import annotations

import configparser
import os
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from poros.harness.matrix import load_matrix

ROOT = Path(__file__).resolve().parents[1]
INI = configparser.ConfigParser(interpolation=None)
INI.read(ROOT / "tox.ini")
ENVS = [e.strip() for e in INI["tox"]["env_list"].split(",")]


def _tox_stack():
    spec = importlib.util.spec_from_file_location("tox_stack", ROOT / "scripts" / "tox_stack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def factor_lines(key: str, env: str) -> list[str]:
    """The lines of [testenv] `key` that apply to `env`: unprefixed ones and those of its factor."""
    out = []
    for line in filter(None, (x.strip() for x in INI["testenv"][key].splitlines())):
        if line.startswith("#"):
            continue
        factors, sep, rest = line.partition(": ")
        if sep and re.fullmatch(r"[\w,]+", factors):
            if env in factors.split(","):
                out.append(rest.strip())
        else:
            out.append(line)
    return out


def pins(env: str) -> dict[str, str]:
    return dict(line.split("==") for line in factor_lines("deps", env))


def test_envs_pin_the_stacks_of_the_same_name():
    stacks = {s.name: s for s in load_matrix("b300").stacks}
    assert ENVS == ["torch210", "torch212"] and set(ENVS) <= set(stacks)
    for env in ENVS:
        s = stacks[env]
        assert pins(env) == {"torch": s.torch, "transformers": s.transformers, "bitsandbytes": s.bitsandbytes}, env
    assert pins("torch210")["torch"] == "2.10.0+cu128" and pins("torch212")["transformers"] == "5.10.1"


def test_each_env_installs_from_the_index_of_its_build():
    for env in ENVS:
        build = pins(env)["torch"].partition("+")[2]
        (index,) = [line for line in factor_lines("set_env", env) if line.startswith("PIP_EXTRA_INDEX_URL")]
        assert index.endswith(f"/whl/{build}"), (env, index)
    assert INI["testenv"]["constrain_package_deps"].strip() == "true"  # poros's dependencies cannot move a pin


def test_envs_run_the_stack_helper_and_tox_is_declared():
    assert INI["testenv"]["commands"].split() == ["python", "scripts/tox_stack.py", "{envtmpdir}", "{posargs}"]
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert any(re.match(r"tox\b", d) for d in dev)


def test_factor_lines_reads_only_its_factor():
    """Negative control: one env's pins are not the other's."""
    assert pins("torch210") != pins("torch212") and "torch==2.12.0+cu130" not in factor_lines("deps", "torch210")


@pytest.mark.skipif(shutil.which("tox") is None, reason="requires tox (pip install -e '.[dev]')")
def test_tox_reads_the_same_configuration():
    done = subprocess.run(["tox", "config", "-e", ",".join(ENVS), "-k", "deps", "commands", "--", "--matrix=b300"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for env in ENVS:
        section = done.stdout.split(f"[testenv:{env}]")[1].split("[testenv:")[0]
        assert all(f"{k}=={v}" in section for k, v in pins(env).items()), section
        assert re.search(r"tox_stack\.py \S+ --matrix=b300", section), section


def test_stack_helper_runs_the_stack_check_or_the_matrix_given():
    ts = _tox_stack()
    check = ts.commands("/tmp/env", [])
    assert [c[2:] for c in check] == [["pytest", "-p", "no:cacheprovider", "tests/engine/test_parity.py"],
                                      ["poros", "bench", "matrix", "matrices/cpu.yaml", "-o", "/tmp/env/out"]]
    (matrix,) = ts.commands("/tmp/env", ["--matrix=b300", "-k", "poros"])
    assert matrix[2:] == ["pytest", "-p", "no:cacheprovider", "suites/", "--matrix=b300", "-k", "poros"]
    assert ts.main([]) == 2  # no scratch folder given


def test_stack_helper_installs_the_unsloth_extra_under_the_pins():
    ts = _tox_stack()
    extra = ts.extra_requirements()
    assert extra and all(r.startswith("unsloth") for r in extra)  # pyproject's [unsloth] extra, as installed
    cmd = ts.install_extra_command({"torch": "2.12.0+cu130", "transformers": "5.10.1", "bitsandbytes": None})
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert cmd[4:] == [*extra, "torch==2.12.0+cu130", "transformers==5.10.1"]


def test_benchmark_histogram_is_declared():
    """`--benchmark-histogram` draws with pygal: pytest-benchmark's histogram extra is a dependency, so an
    install of poros has it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("pytest-benchmark[histogram]") for d in deps), deps
    assert importlib.util.find_spec("pygal") is not None and importlib.util.find_spec("pygaljs") is not None


def test_stack_helper_reads_the_installed_pins():
    from importlib import metadata

    from poros.harness.stacks import installed_torch

    assert _tox_stack().installed() == {"torch": installed_torch(), "transformers": metadata.version("transformers"),
                                        "bitsandbytes": metadata.version("bitsandbytes")}


def test_the_installed_env_pins_and_installs_nothing():
    """`tox -e installed`: the machine's own packages (a GPU machine without an index), poros from the checkout,
    the same helper; not in the default env_list."""
    env = INI["testenv:installed"]
    assert "installed" not in ENVS
    assert env["system_site_packages"].strip() == "true" and env["package"].strip() == "skip"
    assert env["deps"].strip() == ""
    assert "POROS_STACK_EXTRA = 0" in env["set_env"] and "PYTHONPATH = {toxinidir}" in env["set_env"]
    assert "commands" not in env  # [testenv]'s: scripts/tox_stack.py


def test_the_stack_helper_installs_no_extra_when_told(monkeypatch, tmp_path):
    """POROS_STACK_EXTRA=0 (the installed env): not even on a CUDA machine; the control, unset, does install."""
    ts = _tox_stack()
    ran = []
    monkeypatch.setattr(ts, "cuda_present", lambda: True)
    monkeypatch.setattr(ts, "commands", lambda out, args: [])
    monkeypatch.setattr(ts.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setenv("POROS_STACK_EXTRA", "0")
    assert ts.main([str(tmp_path)]) == 0 and ran == []
    monkeypatch.delenv("POROS_STACK_EXTRA")
    assert ts.main([str(tmp_path)]) == 0 and ran and ran[0][2:4] == ["pip", "install"]


def _toxfile():
    spec = importlib.util.spec_from_file_location("toxfile", ROOT / "toxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_env_appends_the_stacks_site_packages_once():
    tf = _toxfile()
    sep = os.pathsep
    assert tf.with_paths(f"/repo{sep}/a", ["/a", "/b"]) == f"/repo{sep}/a{sep}/b"
    assert tf.with_paths("", ["/b"]) == "/b"
    assert tf.site_packages(sys.executable) and tf.site_packages("no-such-python-here") == []


def _installed_env_run(tree: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TOX")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([sys.executable, "-m", "tox", "-e", "installed", "--workdir", str(tmp / "tox"), "--",
                           "--matrix=cpu", "--steps", "1", "--passes", "1", "--parity-steps", "1",
                           "-k", "tiny-qwen2 and method:resident", "--results", str(tmp / "out" / "results.jsonl")],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tox") is None, reason="requires tox (pip install -e '.[dev]')")
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the case needs a python3 that is a virtual environment")
def test_the_installed_env_runs_a_stack_that_lives_in_a_virtual_environment(tmp_path):
    """A GPU image's python3 is often a virtual environment; a virtualenv's system site packages are its base
    interpreter's, so without toxfile.py the env would not see torch. The control runs the same tree without it."""
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns(".*", "__pycache__", "out", "results", "reports", "experiments", "tests", "*.egg-info")
    shutil.copytree(ROOT, tree, ignore=skip)
    done = _installed_env_run(tree, tmp_path)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    (tree / "toxfile.py").unlink()
    control = _installed_env_run(tree, tmp_path)
    assert control.returncode != 0 and "No module named" in control.stdout + control.stderr, control.stdout[-3000:]
