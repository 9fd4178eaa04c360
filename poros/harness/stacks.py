"""Software stacks: the one a process runs on, the ones a matrix pins (each the stack of a tox env), and the
label a results row and a reference row name a stack by, `torch 2.12.0+cu130 / transformers 5.10.1`.

A label carries torch's build (`+cu130`: the CUDA version it was built for; `+cpu`), so two labels name the
same stack only when torch's version, its build and transformers' version all agree (`stack_id`). Nothing
here imports torch: the running torch's version is read from its installed `torch/version.py`."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

TORCH_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+){1,2}(?:\+(?:cu[0-9]+|cpu|rocm[0-9.]+|xpu))?")  # 2.12.0, 2.12.0+cu130
LABEL = re.compile(r"torch ([0-9][^\s+]*)(?:\+(\S+))? / transformers (\S+)")
# torch/version.py's assignments: `__version__ = '2.12.0+cu130'`, `cuda: Optional[str] = '13.0'`, `hip = None`
_VERSION_PY = {k: re.compile(rf"^{k}(?:\s*:[^=]*)?\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
               for k in ("__version__", "cuda", "hip")}


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def torch_build(version: str | None, cuda: str | None = None, hip: str | None = None) -> str | None:
    """torch's build as a stack names it (`cu128`, `cu130`, `rocm6.4`, `cpu`), from what `torch.version` says: the
    CUDA version it was built for (`torch.version.cuda`, 12.8 -> cu128), else its ROCm version, else the build
    `__version__` states after its `+`; a build for neither is `cpu`. The version's suffix is not asked first: an
    index may serve a CUDA build whose version states none."""
    if cuda:
        return "cu" + cuda.replace(".", "")
    if hip:
        return "rocm" + ".".join(hip.split(".")[:2])
    if version is None:
        return None
    return version.partition("+")[2] or "cpu"


def _torch_version_py() -> dict[str, str | None] | None:
    """`__version__`, `cuda` and `hip` of the installed torch's `torch/version.py`, read without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None:
        return None
    for folder in spec.submodule_search_locations or ():
        version_py = Path(folder) / "version.py"
        if version_py.is_file():
            text = version_py.read_text()
            found = {k: _VERSION_PY[k].search(text) for k in _VERSION_PY}
            if found["__version__"]:
                return {k: (m.group(1) if m else None) for k, m in found.items()}
    return None


def installed_torch() -> str | None:
    """The installed torch's version with its build (`2.12.0+cu130`: `torch_build`), without importing torch. A
    wheel from an index records no build in its package metadata; its `torch/version.py` does."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        info = {"__version__": str(torch.__version__), "cuda": getattr(torch.version, "cuda", None),
                "hip": getattr(torch.version, "hip", None)}
    else:
        info = _torch_version_py()
    if info is None:
        return _version("torch")
    version = info["__version__"]
    return f"{version.partition('+')[0]}+{torch_build(version, info['cuda'], info['hip'])}"


def running_label() -> str:
    """The stack this process runs on, e.g. `torch 2.12.0+cu130 / transformers 5.10.1`."""
    return f"torch {installed_torch()} / transformers {_version('transformers')}"


def stack_id(label) -> tuple[str, str, str] | None:
    """(torch version, torch build, transformers version) of a stack label; None for a label that does not
    say all three (no label, another form, or a torch version without its build)."""
    found = LABEL.fullmatch(str(label).strip()) if isinstance(label, str) else None
    if found is None or found.group(2) is None:
        return None
    return found.group(1), found.group(2), found.group(3)


def same_stack(a, b) -> bool:
    """Whether two labels name one stack: torch's version and build and transformers' version agree, each
    stated (a label without torch's build names no stack for certain)."""
    ida = stack_id(a)
    return ida is not None and ida == stack_id(b)


@dataclass(frozen=True)
class Stack:
    """A software stack: `current` (what is installed) or pinned versions provided by a tox env of the same
    name. A pinned `torch` may give its build (`2.12.0+cu130`); then the running torch must be that build."""

    name: str
    torch: str | None = None
    transformers: str | None = None
    bitsandbytes: str | None = None

    @property
    def is_current(self) -> bool:
        return self.name == "current" and self.torch is None

    def label(self) -> str:
        """How rows name the stack: the running one's label where this stack runs here (with torch's build
        whether or not the pin gives it), else the pinned versions."""
        if self.is_current or self.mismatch() is None:
            return running_label()
        return f"torch {self.torch} / transformers {self.transformers}"

    def mismatch(self) -> str | None:
        """Why this stack is not the running environment (None when it is)."""
        if self.is_current:
            return None
        for pkg in ("torch", "transformers", "bitsandbytes"):
            want = getattr(self, pkg)
            have = installed_torch() if pkg == "torch" else _version(pkg)
            if want and (have is None or have.split("+")[0] != want.split("+")[0]):
                return f"stack {self.name} needs {pkg} {want}, this environment has {have}; run it with tox -e {self.name}"
        want_build, have = _build(self.torch), installed_torch()
        if want_build is not None and _build(have) != want_build:
            return (f"stack {self.name} needs torch {self.torch} (build {want_build}), this environment has torch "
                    f"{have}; run it with tox -e {self.name}")
        return None


def _build(version: str | None) -> str | None:
    return (version.partition("+")[2] or None) if version else None


def stack_problems(s: dict, where: str) -> list[str]:
    """What is wrong with a pinned stack's versions as a matrix gives them."""
    bad = [k for k, v in s.items() if not isinstance(v, str)]
    if bad:
        return [f"{where}: {', '.join(bad)} must be strings (quote versions)"]
    if not TORCH_VERSION.fullmatch(s["torch"]):
        return [f"{where}.torch: expected a version, with torch's build where it matters (2.12.0 or "
                f"2.12.0+cu130), got {s['torch']!r}"]
    return []
