"""Which GPUs a row names: NVML lists every GPU of the machine, the row names the ones its process saw."""

from __future__ import annotations

import pytest

from poros.provenance import is_hardware, visible

GPUS = [{"index": i, "uuid": f"GPU-{c}{c}{c}-0000", "name": "NVIDIA H200"} for i, c in enumerate("abc")]


@pytest.mark.parametrize("spec,indices", [
    (None, [0, 1, 2]),       # not set: every GPU
    ("1", [1]),              # the second GPU alone: it is the row's first
    ("2,0", [2, 0]),         # CUDA's order, not NVML's
    ("GPU-bbb", [1]),        # a UUID prefix
    ("0,7,2", [0]),          # an entry that matches nothing ends the list, as for CUDA
    ("", []),                # set but empty: no GPU
])
def test_visible_gpus_in_cuda_order(spec, indices):
    assert [g["index"] for g in visible(GPUS, spec)] == indices


@pytest.mark.parametrize("declared,gpu", [
    ("A100-80GB-PCIe", "NVIDIA A100 80GB PCIe"),   # the reference's label, NVML's name
    ("B300", "NVIDIA B300 SXM6 AC"),
    ("NVIDIA B300 SXM6", "NVIDIA B300 SXM6 AC"),   # matrices/b300.yaml's hardware
    ("NVIDIA H200", "NVIDIA H200"),
    ("h200", "NVIDIA H200 NVL"),
])
def test_a_declared_name_is_the_gpu_it_names(declared, gpu):
    assert is_hardware(declared, gpu)


@pytest.mark.parametrize("declared,gpu", [
    ("B300", "NVIDIA GB300"),                      # a word, not a part of one
    ("A100-80GB-PCIe", "NVIDIA A100-SXM4-80GB"),   # another A100
    ("A100-80GB-PCIe", "NVIDIA A100 80GB"),        # the form is part of the name
    ("B300", "NVIDIA H200"),
    ("", "NVIDIA H200"),                           # an empty name declares nothing
])
def test_a_declared_name_is_not_another_gpu(declared, gpu):
    """Negative control of the above: the words of the declared name must all be the GPU's."""
    assert not is_hardware(declared, gpu)


def _git(cwd, *args) -> str:
    import subprocess

    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(cwd), "PATH": __import__("os").environ["PATH"]}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_the_source_tree_is_the_tree_git_commits_of_the_same_files(tmp_path):
    """Computed from the files alone, with no git, it equals `git rev-parse COMMIT:pkg` for a commit of them; each
    change git would commit (a byte, an executable bit, a new file) changes it, what running leaves does not."""
    import os

    from poros.provenance import source_tree

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.yaml").write_text("k: v\n")
    (pkg / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(pkg / "run.sh", 0o755)
    (pkg / "empty").mkdir()
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "c")
    committed = _git(tmp_path, "rev-parse", "HEAD:pkg")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert source_tree(pkg) == committed
    for change, undo in (
            (lambda: (pkg / "a.py").write_text("x = 2\n"), lambda: (pkg / "a.py").write_text("x = 1\n")),
            (lambda: os.chmod(pkg / "run.sh", 0o644), lambda: os.chmod(pkg / "run.sh", 0o755)),
            (lambda: (pkg / "sub" / "new.py").write_text(""), lambda: (pkg / "sub" / "new.py").unlink())):
        change()
        assert source_tree(pkg) != committed  # negative control: a change git would commit
        undo()
        assert source_tree(pkg) == committed


def test_dirty_is_measured_from_the_files_against_the_commit(monkeypatch):
    """`dirty`: the files' tree against the named commit's (HEAD's, or POROS_GIT_COMMIT's), not an assertion; without
    git the tree is recorded and dirty is unknown."""
    import poros.provenance as P

    head = P._git("rev-parse", "HEAD")
    if head is None or P.committed_tree(head) is None:
        pytest.skip("requires a git checkout of the package")
    monkeypatch.setenv("POROS_GIT_COMMIT", head)
    monkeypatch.setattr(P, "source_tree", lambda: P.committed_tree(head))
    assert P.git_info() == {"commit": head, "dirty": False, "source": "POROS_GIT_COMMIT",
                            "source_tree": P.committed_tree(head)}
    monkeypatch.setattr(P, "source_tree", lambda: "0" * 40)  # the files differ from the commit's
    assert P.git_info()["dirty"] is True
    monkeypatch.setattr(P, "_git", lambda *a: None)  # no git on the machine: the tree alone
    assert P.git_info() == {"commit": head, "dirty": None, "source": "POROS_GIT_COMMIT", "source_tree": "0" * 40}


def test_find_source_names_the_commits_of_a_tree(capsys):
    import poros.provenance as P
    from poros.cli import main

    head = P._git("rev-parse", "HEAD")
    if head is None or P.committed_tree(head) is None:
        pytest.skip("requires a git checkout of the package")
    assert main(["env", "--find-source", P.committed_tree(head), "--branch", "HEAD"]) == 0
    assert head in capsys.readouterr().out.split()
    assert main(["env", "--find-source", "0" * 40, "--branch", "HEAD"]) == 1  # control: a tree no commit has
    assert "no commit on HEAD has poros/ as tree" in capsys.readouterr().out
