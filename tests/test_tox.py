"""tox.ini: each env pins the stack the matrices pin under its name, installs it from the default index under its
constraints file (torch's CUDA build is the default wheel's, checked by torch.version.cuda at run time), and runs
scripts/tox_stack.py: the stack check (the parity tests, then the CPU matrix on its stack), or a matrix's cells."""

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

from poros.harness.matrix import MATRICES, load_matrix

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
    return dict(line.split("==") for line in factor_lines("deps", env) if "==" in line)


def constraints(env: str) -> dict[str, str]:
    """The versions constraints/ENV.txt pins, by package name."""
    path = ROOT / "constraints" / f"{env}.txt"
    lines = [x.strip() for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return {name.lower(): version for name, version in (x.split("==") for x in lines)}


def pinning_matrices() -> dict[str, list]:
    """{stack name: [(matrix, stack), ...]} of every shipped matrix that pins a stack."""
    out: dict[str, list] = {}
    for path in sorted(MATRICES.glob("*.yaml")):
        m = load_matrix(str(path))
        for s in m.stacks:
            if not s.is_current:
                out.setdefault(s.name, []).append((m.name, s))
    return out


def test_envs_pin_the_stacks_of_the_same_name():
    """Every matrix that pins a stack pins the versions its env installs; torch's build is the matrix's to state
    (the index's version carries none)."""
    pinned = pinning_matrices()
    assert ENVS == ["torch210", "torch212"] and set(pinned) == set(ENVS)
    for env in ENVS:
        assert {m for m, _ in pinned[env]} == {"b300", f"cpu-{env}"}, pinned[env]
        for matrix, s in pinned[env]:
            want = {"torch": s.torch.partition("+")[0], "transformers": s.transformers, "bitsandbytes": s.bitsandbytes}
            assert pins(env) == want, (env, matrix)
    assert pins("torch210")["torch"] == "2.10.0" and pins("torch212")["transformers"] == "5.10.1"
    assert {s.torch for _, s in pinned["torch210"]} == {"2.10.0+cu128"}


def test_each_env_installs_from_the_default_index_under_its_constraints():
    """No env names an index of its own (a machine whose only index is the default one installs every env) or a
    `+build` pin (the default index serves none); each installs under constraints/ENV.txt, which pins its stack's
    versions and every other package it installs."""
    text = (ROOT / "tox.ini").read_text()
    assert "INDEX_URL" not in text and "find-links" not in text.lower()
    for env in ENVS:
        assert all("+" not in v for v in pins(env).values()), pins(env)
        assert f"-c constraints/{env}.txt" in [x.replace("{env_name}", env) for x in factor_lines("deps", env)]
        fixed = constraints(env)
        assert {k: fixed[k] for k in pins(env)} == pins(env), env
        assert {"peft", "accelerate", "pytest-benchmark", "numpy"} <= set(fixed), env
    assert INI["testenv"]["constrain_package_deps"].strip() == "true"  # poros's dependencies cannot move a pin


def test_tox_ini_names_no_path_outside_the_checkout():
    """The project works from a plain clone: tox.ini reaches nothing above its folder nor any absolute path."""
    assert outside_paths((ROOT / "tox.ini").read_text()) == []


def outside_paths(text: str) -> list[str]:
    """Paths in `text` outside the checkout: `../x`, `/x` (not a URL's), `~/x`."""
    return re.findall(r"(?:^|[\s=:,\"'(])((?:\.\./|~/|/(?!/))[\w./-]+)", "\n".join(
        x for x in text.splitlines() if not x.lstrip().startswith("#")))


def test_outside_paths_are_found():
    """Negative control: each form is found; `{toxinidir}`, relative paths and URLs are not."""
    text = "deps = -r ../elsewhere/req.txt\nx = /opt/data/a\ny = ~/w\nz = {toxinidir}/a constraints/b.txt https://h/p"
    assert outside_paths(text) == ["../elsewhere/req.txt", "/opt/data/a", "~/w"]


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
    check = ts.commands("/tmp/env", [], "cpu-torch210")
    assert [c[2:] for c in check] == [["pytest", "-p", "no:cacheprovider", "tests/engine/test_parity.py"],
                                      ["poros", "bench", "matrix", "matrices/cpu-torch210.yaml", "-o", "/tmp/env/out"]]
    assert ts.commands("/tmp/env", [])[1][5] == "matrices/cpu.yaml"  # the installed env's: the current stack
    for env in ENVS:  # each env's stack check runs the CPU matrix on its stack
        assert f"POROS_CPU_MATRIX = cpu-{env}" in [x.replace("{env_name}", env) for x in factor_lines("set_env", env)]
        assert {s.name for s in load_matrix(f"cpu-{env}").stacks} == {env}
    assert "POROS_CPU_MATRIX = cpu" in INI["testenv:installed"]["set_env"]
    (matrix,) = ts.commands("/tmp/env", ["--matrix=b300", "-k", "poros"])
    assert matrix[2:] == ["pytest", "-p", "no:cacheprovider", "suites/", "--matrix=b300", "-k", "poros"]
    assert ts.main([]) == 2  # no scratch folder given


def test_stack_helper_installs_the_unsloth_extra_under_the_pins():
    ts = _tox_stack()
    extra = ts.extra_requirements()
    assert extra and all(r.startswith("unsloth") for r in extra)  # pyproject's [unsloth] extra, as installed
    cmd = ts.install_extra_command({"torch": "2.12.0", "transformers": "5.10.1", "bitsandbytes": None})
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert cmd[4:] == [*extra, "torch==2.12.0", "transformers==5.10.1"]


def test_benchmark_histogram_is_declared():
    """`--benchmark-histogram` draws with pygal: pytest-benchmark's histogram extra is a dependency, so an
    install of poros has it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("pytest-benchmark[histogram]") for d in deps), deps
    assert importlib.util.find_spec("pygal") is not None and importlib.util.find_spec("pygaljs") is not None


def test_stack_helper_reads_the_installed_pins():
    """As package metadata states them: an installed torch `2.10.0` satisfies the pin `torch==2.10.0`, which pip
    then keeps; `2.10.0+cu128` would match no installed or indexed torch."""
    from importlib import metadata

    assert _tox_stack().installed() == {pkg: metadata.version(pkg) for pkg in ("torch", "transformers", "bitsandbytes")}


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
    monkeypatch.setattr(ts, "commands", lambda out, args, matrix: [])
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
