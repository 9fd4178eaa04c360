"""Where and with what a result was produced: recorded automatically with every result."""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata as md
import os
import platform
import re
import socket
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import poros

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "unsloth", "poros")


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _poros_version() -> str:
    return _version("poros") or poros.__version__


PACKAGE = Path(poros.__file__).resolve().parent  # the source files that run
_NOT_SOURCE = ("__pycache__",)  # what running leaves beside the sources (never committed)


def _blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def source_tree(folder: Path = PACKAGE) -> str | None:
    """The git tree id that `folder`'s files would have committed (`git rev-parse COMMIT:poros` for the package),
    computed from the files themselves, with or without git: a hash of the source files that ran which a reader
    checks against any commit. Python's caches are left out; None for a folder without files.

    Git's rules: a file's blob is sha1("blob SIZE\\0" + bytes), mode 100755 where executable else 100644, a link's
    its target (120000); a tree lists its entries sorted by name, a folder's name as though it ended in "/"."""
    entries = []
    for child in folder.iterdir():
        if child.name in _NOT_SOURCE or child.suffix in (".pyc", ".pyo"):
            continue
        if child.is_symlink():
            mode, sha = "120000", _blob(os.readlink(child).encode())
        elif child.is_dir():
            sha = source_tree(child)
            if sha is None:  # git keeps no empty folder
                continue
            mode = "40000"
        elif child.is_file():
            mode = "100755" if os.access(child, os.X_OK) else "100644"
            sha = _blob(child.read_bytes())
        else:
            continue
        entries.append((child.name + ("/" if mode == "40000" else ""), mode, child.name, sha))
    if not entries:
        return None
    body = b"".join(f"{mode} {name}".encode() + b"\0" + bytes.fromhex(sha) for _, mode, name, sha in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def committed_tree(commit: str) -> str | None:
    """The tree of the package's folder at `commit` in the checkout the package runs from (None without git, with
    no such commit, or where the package is not a checkout's `poros/`)."""
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != REPO or PACKAGE != REPO / "poros":
        return None
    return _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}:poros")


def git_info() -> dict:
    """The engine that runs: its commit, whether its source files differ from that commit's (`dirty`), and the
    files' own hash (`source_tree`, what `git rev-parse COMMIT:poros` gives for a commit of the same files).

    The commit is git's HEAD, or POROS_GIT_COMMIT where set: a tree copied onto a GPU machine may carry no .git,
    or a stale one that names an older commit than what runs. `dirty` is measured, not asserted: the source
    tree of the files against the commit's own, where git knows the commit (None where it does not: then
    `poros env --find-source TREE` in a checkout names the commits whose package is that tree)."""
    tree = source_tree()
    if os.environ.get("POROS_GIT_COMMIT"):
        commit, source = os.environ["POROS_GIT_COMMIT"], "POROS_GIT_COMMIT"
    else:
        commit, source = _git("rev-parse", "HEAD"), "git"
    committed = committed_tree(commit) if commit else None
    dirty = None if committed is None or tree is None else committed != tree
    return {"commit": commit, "dirty": dirty, "source": source, "source_tree": tree}


def commits_of_tree(tree: str, branch: str = "main") -> list[str]:
    """The commits on `branch` (newest first) whose package folder is `tree`: where a row's engine came from when
    it ran without git. Empty without git.

    Raises:
        PorosError: `branch` is not in this checkout."""
    from poros.errors import PorosError

    if _git("rev-parse", "--verify", "--quiet", branch) is None:
        raise PorosError(f"{branch}: no such branch in this checkout ({REPO}); pass --branch NAME")
    commits = (_git("log", "--format=%H", branch) or "").split()
    try:
        out = subprocess.run(["git", "cat-file", "--batch-check"], cwd=REPO, capture_output=True, text=True,
                             input="".join(f"{c}:poros\n" for c in commits), timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = [line.split()[0] for line in out.stdout.splitlines()]
    return [c for c, t in zip(commits, found) if t == tree]


def visible(gpus: list[dict], spec: str | None) -> list[dict]:
    """The GPUs a process sees, in CUDA's order: NVML lists every GPU of the machine whatever
    CUDA_VISIBLE_DEVICES says (`spec`: indices or UUIDs, comma-separated), so a row's first GPU is the one
    it ran on only once filtered. An entry that matches no GPU ends the list, as it does for CUDA."""
    if spec is None:
        return gpus
    out = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        match = [g for g in gpus if (token.isdigit() and g["index"] == int(token)) or
                 (not token.isdigit() and g["uuid"].startswith(token))]
        if len(match) != 1:
            break
        out.append(match[0])
    return out


def hardware_words(name: str) -> list[str]:
    """The words of a hardware name, case and punctuation aside and the vendor dropped: 'NVIDIA A100 80GB PCIe'
    and 'A100-80GB-PCIe' are both ['a100', '80gb', 'pcie']."""
    return [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w != "nvidia"]


def is_hardware(declared: str, gpu_name: str) -> bool:
    """Whether a GPU named `gpu_name` (as NVML or CUDA names it: 'NVIDIA A100 80GB PCIe', 'NVIDIA B300 SXM6 AC')
    is the hardware a matrix or a reference declares ('NVIDIA H200', 'A100-80GB-PCIe', 'B300'): every word of the
    declared name is a word of the GPU's (`hardware_words`), so 'B300' is not an 'NVIDIA GB300' and
    'A100-80GB-PCIe' is not an 'NVIDIA A100-SXM4-80GB'."""
    words = hardware_words(declared)
    return bool(words) and set(words) <= set(hardware_words(gpu_name))


def gpu_info() -> list[dict]:
    """Name, UUID, driver and memory of every GPU this process can see (CUDA_VISIBLE_DEVICES), via NVML
    when it is present."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(
                {
                    "index": i,
                    "name": _s(pynvml.nvmlDeviceGetName(h)),
                    "uuid": _s(pynvml.nvmlDeviceGetUUID(h)),
                    "driver": _s(driver),
                    "memory_gb": round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9, 1),
                }
            )
        return visible(out, os.environ.get("CUDA_VISIBLE_DEVICES"))
    finally:
        pynvml.nvmlShutdown()


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@lru_cache(maxsize=1)
def _static() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {**{p: _version(p) for p in PACKAGES}, "poros": _poros_version()},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "git": git_info(),
        "gpus": gpu_info(),
        "host": socket.gethostname(),
    }


def provenance() -> dict:
    """Versions, git commit and dirty flag, GPUs (name/UUID/driver), host and a timestamp."""
    info = dict(_static())
    info["time"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    info["argv"] = sys.argv
    return info


def this_gpu_uuid() -> str | None:
    """The UUID of the GPU this process measures on (CUDA's first visible device; None without one)."""
    gpus = _static()["gpus"]
    return gpus[0]["uuid"] if gpus else None


def current_commit() -> str | None:
    """The commit this process runs (`git_info`, read once)."""
    return _static()["git"]["commit"]


def env_block() -> str:
    """A copy-and-paste environment block for bug reports (`poros env`)."""
    import torch

    p = _static()
    git = p["git"]
    lines = [
        "- poros: " + f"{p['versions']['poros']} (commit {git['commit'] or 'unknown'}{', dirty' if git['dirty'] else ''}, "
        f"source tree {git['source_tree'] or 'unknown'})",
        f"- Python: {p['python']} ({p['platform']})",
        f"- torch: {p['torch']} (CUDA {p['cuda'] or 'none'}, cuDNN {p['cudnn'] or 'none'}, "
        f"CUDA available: {torch.cuda.is_available()})",
    ]
    for pkg in ("transformers", "peft", "bitsandbytes", "accelerate", "unsloth"):
        lines.append(f"- {pkg}: {p['versions'][pkg] or 'not installed'}")
    if p["gpus"]:
        for g in p["gpus"]:
            lines.append(f"- GPU {g['index']}: {g['name']} ({g['memory_gb']} GB, UUID {g['uuid']}, driver {g['driver']})")
    else:
        lines.append("- GPU: none visible to NVML")
    lines.append(f"- host: {p['host']}")
    return "\n".join(lines)
