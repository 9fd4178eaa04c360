"""Where and with what a result was produced: recorded automatically with every result."""

from __future__ import annotations

import datetime as _dt
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


def git_info() -> dict:
    """Commit and dirty flag of the checkout. POROS_GIT_COMMIT, when set, wins: a tree copied onto
    a GPU machine may carry no .git, or a stale one that names an older commit than what runs."""
    import os

    if os.environ.get("POROS_GIT_COMMIT"):
        return {"commit": os.environ["POROS_GIT_COMMIT"], "dirty": None, "source": "POROS_GIT_COMMIT"}
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if dirty is None else bool(dirty)}


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
        "- poros: " + f"{p['versions']['poros']} (commit {git['commit'] or 'unknown'}{', dirty' if git['dirty'] else ''})",
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
