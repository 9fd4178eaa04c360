"""Matrix files (`matrices/*.yaml`): typed, validated data describing a benchmark sweep."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from poros.config import Device, Method
from poros.errors import ConfigError
from poros.models.shapes import SHAPES
from poros.provenance import stack_label
from poros.settings import BY_NAME, RUN, SCHEDULE_NAMES, SETTINGS, check_values

MATRICES = Path(__file__).resolve().parents[2] / "matrices"
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
    """A benchmark sweep: models x stacks x methods, the run's repetitions, and every training setting
    (poros/settings.py) at the matrix's level, with per-model changes to how poros schedules them."""

    name: str
    steps: int
    passes: int
    dataset: str
    methods: tuple[Method, ...]
    models: tuple[str, ...]
    stacks: tuple[Stack, ...]
    settings: dict  # every setting of the table that is not RUN-only: the matrix's value or the default
    hardware: str | None = None
    precision: str = "nf4"
    warmup_passes: int = 1
    device: Device | None = None
    parity_steps: int = 3
    # per-model schedule settings that differ from the matrix's: ((model, ((key, value), ...)), ...)
    model_overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    source: str = ""

    def __getattr__(self, name: str):  # matrix.seq_len etc.: the settings by name
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(name)

    def overrides_for(self, model: str) -> dict:
        """The schedule settings `model` runs with instead of the matrix's."""
        return dict(next((kv for m, kv in self.model_overrides if m == model), ()))

    def settings_for(self, model: str) -> dict:
        """Every setting `model`'s cells run with."""
        return {**self.settings, **self.overrides_for(model)}

    def with_overrides(self, steps: int | None = None, passes: int | None = None) -> "Matrix":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if steps is not None:
            values["steps"] = steps
        if passes is not None:
            values["passes"] = passes
        return Matrix(**values)


_REQUIRED = ("name", "steps", "passes", "dataset", "methods", "models", "stacks")
_OPTIONAL = ("hardware", "precision", "warmup_passes", "device", "parity_steps", "model_overrides")
_MATRIX_SETTINGS = tuple(s.name for s in SETTINGS if s.kind != RUN)  # settings a matrix may set
# what `model_overrides` may set per model: how poros schedules its work, never what is computed


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
        for k in settings:
            if k not in SCHEDULE_NAMES:
                problems.append(f"{where}.{k}: not overridable per model (only the schedule settings "
                                f"{', '.join(SCHEDULE_NAMES)}; what is computed is the same for every model)")
        values, bad = check_values({k: v for k, v in settings.items() if k in SCHEDULE_NAMES}, f"{where}.")
        problems += bad
        out.append((model, tuple(values.items())))
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
    return name in SHAPES or Path(name).expanduser().is_dir()


def parse_matrix(data, source: str = "<matrix>") -> Matrix:
    """Validate raw matrix data; raise one ConfigError listing every problem by key."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise ConfigError([f"expected a mapping at the top level, got {type(data).__name__}"], source)
    for k in sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL) - set(_MATRIX_SETTINGS)):
        problems.append(f"{k}: unknown key" + (" (a run setting: it is given on the command line)"
                                               if k in BY_NAME else ""))
    for k in _REQUIRED:
        if k not in data:
            problems.append(f"{k}: missing required key")
    settings, bad = check_values({k: v for k, v in data.items() if k in _MATRIX_SETTINGS})
    problems += bad
    for k in ("steps", "passes", "warmup_passes", "parity_steps"):
        least = 0 if k == "warmup_passes" else 1
        if k in data and not (_is_int(data[k]) and data[k] >= least):
            problems.append(f"{k}: expected an integer >= {least}, got {data[k]!r}")
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
    device = None
    if data.get("device") is not None:
        try:
            device = Device(data["device"])
        except ValueError:
            problems.append(f"device: expected one of {', '.join(d.value for d in Device)}, got {data['device']!r}")
    if problems:
        raise ConfigError(problems, source)
    return Matrix(
        name=data["name"], steps=data["steps"], passes=data["passes"], dataset=data["dataset"],
        methods=tuple(methods), models=tuple(models), stacks=stacks,
        settings={**{k: BY_NAME[k].default for k in _MATRIX_SETTINGS}, **settings},
        hardware=data.get("hardware"), precision=data.get("precision", "nf4").lower(),
        warmup_passes=data.get("warmup_passes", 1), device=device, parity_steps=data.get("parity_steps", 3),
        model_overrides=overrides, source=source,
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
