"""Matrix files (`matrices/*.yaml`): typed, validated data describing a benchmark sweep."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from poros.config import Attention, Device, Method
from poros.errors import ConfigError

MATRICES = Path(__file__).resolve().parent.parent / "matrices"
DATASETS = ("synthetic",)
PRECISIONS = ("nf4",)


@dataclass(frozen=True)
class Stack:
    """A software stack: `current` (what is installed) or pinned versions provided by a tox env."""

    name: str
    torch: str | None = None
    transformers: str | None = None
    bitsandbytes: str | None = None

    @property
    def is_current(self) -> bool:
        return self.name == "current" and self.torch is None

    def label(self) -> str:
        if self.is_current:
            from poros.provenance import stack_label

            return stack_label()
        return f"torch {self.torch} / transformers {self.transformers}"

    def mismatch(self) -> str | None:
        """Why this stack is not the running environment (None when it is)."""
        if self.is_current:
            return None
        for pkg in ("torch", "transformers", "bitsandbytes"):
            want = getattr(self, pkg)
            try:
                have = md.version(pkg)
            except md.PackageNotFoundError:
                have = None
            if want and (have is None or have.split("+")[0] != want.split("+")[0]):
                return f"stack {self.name} needs {pkg} {want}, this environment has {have}; run it with tox -e {self.name}"
        return None


@dataclass(frozen=True)
class Matrix:
    name: str
    steps: int
    passes: int
    seq_len: int
    batch_size: int
    grad_accum: int
    lora_rank: int
    lora_alpha: int
    block_size: int
    dataset: str
    methods: tuple[Method, ...]
    models: tuple[str, ...]
    stacks: tuple[Stack, ...]
    hardware: str | None = None
    precision: str = "nf4"
    warmup_passes: int = 1
    attention: Attention = Attention.DEFAULT
    device: Device | None = None
    deterministic: bool = False
    activation_offload: float = 0.0
    overlap_backward: bool = True
    cuda_graphs: bool = False
    parity_steps: int = 3
    # per-model schedule settings that differ from the matrix's: ((model, ((key, value), ...)), ...)
    model_overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    source: str = ""

    def overrides_for(self, model: str) -> dict:
        """The schedule settings `model` runs with instead of the matrix's."""
        return dict(next((kv for m, kv in self.model_overrides if m == model), ()))

    def with_overrides(self, steps: int | None = None, passes: int | None = None) -> "Matrix":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if steps is not None:
            values["steps"] = steps
        if passes is not None:
            values["passes"] = passes
        return Matrix(**values)

    def config_rows(self) -> list[tuple[str, str]]:
        """The seed's Configuration table."""
        return [
            ("Hardware", self.hardware or "(as recorded in provenance)"),
            ("Precision", self.precision.upper()),
            ("Steps × passes", f"{self.steps} steps × {self.passes} passes (warmup {self.warmup_passes} discarded; median ± std across passes)"),
            ("Sequence length", str(self.seq_len)),
            ("Batch / grad-accum", f"{self.batch_size} / {self.grad_accum}"),
            ("LoRA", f"rank {self.lora_rank}, alpha {self.lora_alpha}"),
            ("Block size (poros)", str(self.block_size)),
            ("Dataset", f"`{self.dataset}`"),
            ("Attention", self.attention.value + (" (deterministic algorithms)" if self.deterministic else "")),
            ("Methods", ", ".join(m.value for m in self.methods)),
            ("Software stacks", "; ".join(s.label() for s in self.stacks)),
        ]


_REQUIRED_INT = ("steps", "passes", "seq_len", "batch_size", "grad_accum", "lora_rank", "lora_alpha", "block_size")
_REQUIRED = _REQUIRED_INT + ("name", "dataset", "methods", "models", "stacks")
_OPTIONAL = ("hardware", "precision", "warmup_passes", "attention", "device", "deterministic", "activation_offload",
             "overlap_backward", "cuda_graphs", "parity_steps", "model_overrides")
# settings checked by kind, at the top level and in `model_overrides`
_FLAGS = ("deterministic", "overlap_backward", "cuda_graphs")
_FRACTIONS = ("activation_offload",)
# what `model_overrides` may set per model: how poros schedules its work, never what is computed
_OVERRIDABLE = ("overlap_backward", "cuda_graphs", "activation_offload")


def _value_problem(key: str, value) -> str | None:
    """Why `value` is not valid for flag or fraction setting `key` (None when it is)."""
    if key in _FLAGS and not isinstance(value, bool):
        return f"expected true or false, got {value!r}"
    if key in _FRACTIONS and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        return f"expected a number from 0 to 1, got {value!r}"
    return None


def _parse_overrides(value, models: list[str], problems: list[str]) -> tuple:
    if not isinstance(value, dict):
        problems.append(f"model_overrides: expected a mapping of model to settings, got {value!r}")
        return ()
    out = []
    for model, settings in value.items():
        where = f"model_overrides.{model}"
        if model not in models:
            problems.append(f"{where}: not one of this matrix's models")
            continue
        if not isinstance(settings, dict) or not settings:
            problems.append(f"{where}: expected a non-empty mapping of settings, got {settings!r}")
            continue
        kv = []
        for k, v in settings.items():
            why = (f"not overridable per model (only {', '.join(sorted(_OVERRIDABLE))})"
                   if k not in _OVERRIDABLE else _value_problem(k, v))
            if why:
                problems.append(f"{where}.{k}: {why}")
            else:
                kv.append((k, float(v) if k in _FRACTIONS else v))
        out.append((model, tuple(kv)))
    return tuple(out)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_stacks(value, problems: list[str]) -> tuple[Stack, ...]:
    if not isinstance(value, list) or not value:
        problems.append(f"stacks: expected a non-empty list, got {value!r}")
        return ()
    out = []
    for i, s in enumerate(value):
        if s == "current":
            out.append(Stack("current"))
        elif isinstance(s, dict):
            unknown = set(s) - {"name", "torch", "transformers", "bitsandbytes"}
            missing = {"name", "torch", "transformers", "bitsandbytes"} - set(s)
            if unknown:
                problems.append(f"stacks[{i}]: unknown key(s) {', '.join(sorted(unknown))}")
            if missing:
                problems.append(f"stacks[{i}]: missing key(s) {', '.join(sorted(missing))}")
            if not unknown and not missing:
                bad = [k for k, v in s.items() if not isinstance(v, str)]
                if bad:
                    problems.append(f"stacks[{i}]: {', '.join(bad)} must be strings (quote versions)")
                else:
                    out.append(Stack(**s))
        else:
            problems.append(f"stacks[{i}]: expected 'current' or a mapping {{name, torch, transformers, bitsandbytes}}, got {s!r}")
    return tuple(out)


def _known_model(name: str) -> bool:
    from poros.registry import SHAPES

    return name in SHAPES or Path(name).expanduser().is_dir()


def parse_matrix(data, source: str = "<matrix>") -> Matrix:
    """Validate raw matrix data; raise one ConfigError listing every problem by key."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping at the top level, got {type(data).__name__}"], source)
    for k in sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL)):
        problems.append(f"{k}: unknown key")
    for k in _REQUIRED:
        if k not in data:
            problems.append(f"{k}: missing required key")
    for k in _FLAGS + _FRACTIONS:
        why = _value_problem(k, data[k]) if k in data else None
        if why:
            problems.append(f"{k}: {why}")
    for k in _REQUIRED_INT + ("warmup_passes", "parity_steps"):
        if k in data and not (_is_int(data[k]) and data[k] >= (0 if k == "warmup_passes" else 1)):
            problems.append(f"{k}: expected an integer >= {0 if k == 'warmup_passes' else 1}, got {data[k]!r}")
    for k in ("name", "hardware", "precision", "dataset"):
        if k in data and not isinstance(data[k], str):
            problems.append(f"{k}: expected a string, got {data[k]!r}")
    if isinstance(data.get("dataset"), str) and data["dataset"] not in DATASETS:
        problems.append(f"dataset: expected one of {', '.join(DATASETS)}, got {data['dataset']!r}")
    if isinstance(data.get("precision"), str) and data["precision"].lower() not in PRECISIONS:
        problems.append(f"precision: expected one of {', '.join(PRECISIONS)}, got {data['precision']!r}")
    methods: list[Method] = []
    if "methods" in data:
        if not isinstance(data["methods"], list) or not data["methods"]:
            problems.append(f"methods: expected a non-empty list, got {data['methods']!r}")
        else:
            for m in data["methods"]:
                try:
                    methods.append(Method(m))
                except ValueError:
                    problems.append(f"methods: unknown method {m!r} (known: {', '.join(x.value for x in Method)})")
    models: list[str] = []
    if "models" in data:
        if not isinstance(data["models"], list) or not data["models"]:
            problems.append(f"models: expected a non-empty list, got {data['models']!r}")
        else:
            for m in data["models"]:
                if not isinstance(m, str) or not _known_model(m):
                    problems.append(f"models: unknown model {m!r} (not registered, not a checkpoint folder)")
                else:
                    models.append(m)
    stacks = _parse_stacks(data["stacks"], problems) if "stacks" in data else ()
    overrides = _parse_overrides(data["model_overrides"], models, problems) if "model_overrides" in data else ()
    attention = Attention.DEFAULT
    if "attention" in data:
        try:
            attention = Attention(data["attention"])
        except ValueError:
            problems.append(f"attention: expected one of {', '.join(a.value for a in Attention)}, got {data['attention']!r}")
    device = None
    if data.get("device") is not None:
        try:
            device = Device(data["device"])
        except ValueError:
            problems.append(f"device: expected one of {', '.join(d.value for d in Device)}, got {data['device']!r}")
    if problems:
        raise ConfigError(problems, source)
    return Matrix(
        name=data["name"],
        **{k: data[k] for k in _REQUIRED_INT},
        dataset=data["dataset"],
        methods=tuple(methods),
        models=tuple(models),
        stacks=stacks,
        hardware=data.get("hardware"),
        precision=data.get("precision", "nf4").lower(),
        warmup_passes=data.get("warmup_passes", 1),
        attention=attention,
        device=device,
        deterministic=data.get("deterministic", False),
        activation_offload=float(data.get("activation_offload", 0.0)),
        overlap_backward=data.get("overlap_backward", True),
        cuda_graphs=data.get("cuda_graphs", False),
        parity_steps=data.get("parity_steps", 3),
        model_overrides=overrides,
        source=source,
    )


def resolve_matrix_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.is_file():
        return p
    candidate = MATRICES / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    known = ", ".join(sorted(x.stem for x in MATRICES.glob("*.yaml")))
    raise ConfigError([f"matrix {name_or_path!r} is neither a file nor one of: {known}"], "matrix")


def load_matrix(name_or_path: str) -> Matrix:
    """Load and validate a matrix by name (`cpu`) or path (`matrices/cpu.yaml`)."""
    path = resolve_matrix_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {str(e).splitlines()[0]}"], str(path)) from None
    return parse_matrix(data, str(path))
