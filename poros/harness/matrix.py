"""Matrix files (`matrices/*.yaml`): typed, validated data describing a benchmark sweep."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from poros.common.yamlfile import load_yaml
from poros.config import Device, Method
from poros.errors import ConfigError
from poros.models.shapes import SHAPES
from poros.harness.stacks import Stack, stack_problems
from poros.resolve import with_defaults
from poros.settings import BY_NAME, COMPUTED_NAMES, RUN, SCHEDULE_NAMES, SETTINGS, check_values

MATRICES = Path(__file__).resolve().parents[1] / "matrices"  # shipped in the package (a checkout links matrices/ to it)
DATASETS = ("synthetic",)
PRECISIONS = ("nf4",)


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
    settings: dict  # every setting of the table that is not RUN-only: the matrix's value or the table's default
    hardware: str | None = None
    precision: str = "nf4"
    warmup_passes: int = 1
    device: Device | None = None
    parity_steps: int = 3
    # per-model schedule settings that differ from the matrix's: ((model, ((key, value), ...)), ...)
    model_overrides: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    # computed settings swept: ((key, (value, ...)), ...); every combination is a point of cells
    sweep: tuple[tuple[str, tuple], ...] = ()
    # poros's schedules by name: ((name, ((key, value), ...)), ...); each is a poros cell of its own
    plans: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    # computed settings one method's timed cells run with instead of the matrix's (a gate runs both sides
    # with the gated method's): ((method, ((key, value), ...)), ...)
    method_settings: tuple[tuple[Method, tuple[tuple[str, object], ...]], ...] = ()
    # steps of each warm-up pass (None: `steps`); not `warmup_steps`, the learning rate's warm-up (a setting)
    warmup_pass_steps: int | None = None
    # the hardware of the reference figures this matrix measures again, as the reference CSV names it (B300):
    # its methods must run on the attention paths the reference's note says (poros.harness.protocol)
    reference: str | None = None
    source: str = ""
    # the settings the matrix names at its top level: the others take the device's defaults, then the table's
    named: frozenset[str] = frozenset()

    def __getattr__(self, name: str):  # matrix.seq_len etc.: the settings by name
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        raise AttributeError(name)

    def overrides_for(self, model: str) -> dict:
        """The schedule settings `model` runs with instead of the matrix's."""
        return dict(next((kv for m, kv in self.model_overrides if m == model), ()))

    def points(self) -> list[dict]:
        """Every combination of the swept values ([{}] without a sweep), in the order the axes are given."""
        keys = [k for k, _ in self.sweep]
        return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in self.sweep))]

    def most_ranks(self) -> int:
        """The most data-parallel ranks (`gpus`) a cell of this matrix runs on: the matrix's, or its sweep's
        largest (neither plans, models nor methods set it)."""
        return max(point.get("gpus", self.settings.get("gpus", 1)) for point in self.points())

    def plan_names(self) -> list[str | None]:
        """The poros plans by name ([None]: the matrix's own schedule, without a `plans:` axis)."""
        return [name for name, _ in self.plans] or [None]

    def plan_settings(self, plan: str | None) -> dict:
        return dict(next((kv for n, kv in self.plans if n == plan), ()))

    def method_overrides(self, method: Method | None) -> dict:
        return dict(next((kv for m, kv in self.method_settings if m is method), ()))

    def settings_for(self, model: str, point: dict | None = None, method: Method | None = None,
                     plan: str | None = None, device: Device | str | None = None) -> dict:
        """Every setting a cell of `model` runs with: the matrix's, the sweep point's, the method's, the
        model's schedule overrides and the plan's, later ones winning; then, for what none of them names, the
        defaults of `device` (default: the matrix's; poros/resolve.py, the settings `poros train` takes there;
        poros's schedule ones for poros's cells and gates alone), then the table's."""
        given = {**{k: self.settings[k] for k in self.named}, **(point or {}), **self.method_overrides(method),
                 **self.overrides_for(model), **self.plan_settings(plan)}
        leave = () if method in (None, Method.POROS) else SCHEDULE_NAMES
        resolved, _ = with_defaults(given, device if device is not None else self.device, leave=leave)
        resolved.pop("device", None)  # a run setting: the cell's config takes it apart
        return {**self.settings, **given, **resolved}

    def with_overrides(self, steps: int | None = None, passes: int | None = None) -> "Matrix":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if steps is not None:
            values["steps"] = steps
        if passes is not None:
            values["passes"] = passes
        return Matrix(**values)


_REQUIRED = ("name", "steps", "passes", "dataset", "methods", "models", "stacks")
_OPTIONAL = ("hardware", "precision", "warmup_passes", "warmup_pass_steps", "device", "parity_steps", "model_overrides",
             "sweep", "plans", "method_settings", "reference")
PLAN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+]*")  # readable in cell ids and selectable with -k
# a matrix is found again by its name (`matrices/NAME.yaml`, rows' `matrix`, `poros bench status`): a file name
MATRIX_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
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


def _parse_sweep(value, top_level: dict, problems: list[str]) -> tuple:
    if not isinstance(value, dict) or not value:
        problems.append(f"sweep: expected a mapping of computed settings to lists of values, got {value!r}")
        return ()
    out = []
    for k, values in value.items():
        where = f"sweep.{k}"
        if k not in COMPUTED_NAMES:
            problems.append(f"{where}: not a computed setting (a sweep varies what is computed: "
                            f"{', '.join(COMPUTED_NAMES)}; poros's schedules go under plans:)")
            continue
        if k in top_level:
            problems.append(f"{where}: also set at the top level; give it in one place")
            continue
        if not isinstance(values, list) or not values:
            problems.append(f"{where}: expected a non-empty list of values, got {values!r}")
            continue
        checked = []
        for i, v in enumerate(values):
            got, bad = check_values({k: v}, f"{where}[{i}].")
            problems += [b.replace(f"{where}[{i}].{k}:", f"{where}[{i}]:") for b in bad]
            checked += got.values()
        if len(checked) == len(values):
            if len(set(map(str, checked))) != len(checked):
                problems.append(f"{where}: a value is given twice ({values!r})")
            else:
                out.append((k, tuple(checked)))
    return tuple(out)


def _parse_named(value, key: str, names, what: str, problems: list[str], name_check=None) -> tuple:
    """A mapping of names to settings mappings, each setting one of `names` (plans:, method_settings:)."""
    if not isinstance(value, dict) or not value:
        problems.append(f"{key}: expected a non-empty mapping, got {value!r}")
        return ()
    out = []
    for name, settings in value.items():
        where = f"{key}.{name}"
        if name_check is not None:
            why = name_check(name)
            if why:
                problems.append(f"{where}: {why}")
                continue
        settings = {} if settings is None else settings
        if not isinstance(settings, dict):
            problems.append(f"{where}: expected a mapping of settings ({{}} for none), got {settings!r}")
            continue
        for k in settings:
            if k not in names:
                problems.append(f"{where}.{k}: not {what} ({', '.join(names)})")
        values, bad = check_values({k: v for k, v in settings.items() if k in names}, f"{where}.")
        problems += bad
        out.append((name, tuple(values.items())))
    return tuple(out)


def _plan_name_problem(name) -> str | None:
    if not isinstance(name, str) or not PLAN_NAME.fullmatch(name):
        return (f"expected a plan name of letters, digits, '_', '.' or '+' (it is part of cell ids, "
                f"e.g. 24GB or streamed), got {name!r}")
    return None


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
                bad = stack_problems(s, f"stacks[{i}]")
                problems += bad
                if not bad:
                    out.append(Stack(**s))
        else:
            problems.append(f"stacks[{i}]: expected 'current' or a mapping {{name, torch, transformers, bitsandbytes}}, got {s!r}")
    names = [s.name for s in out]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"stacks: {name} is listed twice; name each stack once")
    return tuple(out)


def _model_identity(name: str) -> str:
    """What a model entry names: a registered shape, or a checkpoint folder wherever it is written from."""
    return name if name in SHAPES else str(Path(name).expanduser().resolve())


def _known_model(name: str) -> bool:
    try:
        return name in SHAPES or Path(name).expanduser().is_dir()
    except OSError:  # a name too long for a path (ENAMETOOLONG) names no folder
        return False


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
    for k in ("steps", "passes", "warmup_passes", "warmup_pass_steps", "parity_steps"):
        least = 0 if k == "warmup_passes" else 1
        if k in data and not (_is_int(data[k]) and data[k] >= least):
            problems.append(f"{k}: expected an integer >= {least}, got {data[k]!r}")
    for k in ("name", "hardware", "precision", "dataset", "reference"):
        if k in data and not isinstance(data[k], str):
            problems.append(f"{k}: expected a string, got {data[k]!r}")
    if isinstance(data.get("name"), str) and not MATRIX_NAME.fullmatch(data["name"]):
        problems.append(f"name: expected a matrix name of letters, digits, '-', '_', '.' or '+' (its file is "
                        f"matrices/NAME.yaml), got {data['name']!r:.80}")
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
                    continue
                if methods.count(methods[-1]) > 1:
                    problems.append(f"methods: {m} is listed twice; list each method once")
                    methods.pop()
    models: list[str] = []
    if "models" in data:
        if not isinstance(data["models"], list) or not data["models"]:
            problems.append(f"models: expected a non-empty list, got {data['models']!r}")
        else:
            seen: dict[str, str] = {}
            for m in data["models"]:
                if not isinstance(m, str) or not _known_model(m):
                    problems.append(f"models: unknown model {m!r} (not registered, not a checkpoint folder)")
                elif _model_identity(m) in seen:
                    twice = "" if seen[_model_identity(m)] == m else f" (as {seen[_model_identity(m)]!r} too)"
                    problems.append(f"models: {m!r} is listed twice{twice}; list each model once")
                else:
                    seen[_model_identity(m)] = m
                    models.append(m)
    stacks = _parse_stacks(data["stacks"], problems) if "stacks" in data else ()
    overrides = _parse_overrides(data["model_overrides"], models, problems) if "model_overrides" in data else ()
    sweep = _parse_sweep(data["sweep"], settings, problems) if "sweep" in data else ()
    plans = ()
    if "plans" in data:
        plans = _parse_named(data["plans"], "plans", SCHEDULE_NAMES, "a schedule setting", problems,
                             _plan_name_problem)
        if Method.POROS not in methods and "methods" in data:
            problems.append("plans: are poros's schedules, and poros is not among this matrix's methods")
    method_settings = ()
    if "method_settings" in data:
        swept = {k for k, _ in sweep}

        def method_problem(name):
            try:
                meth = Method(name)
            except ValueError:
                return f"unknown method (known: {', '.join(x.value for x in Method)})"
            return None if meth in methods else "not one of this matrix's methods"

        named = _parse_named(data["method_settings"], "method_settings",
                             tuple(k for k in COMPUTED_NAMES if k not in swept and k != "gpus"),
                             "a computed setting that is neither swept nor gpus", problems, method_problem)
        method_settings = tuple((Method(name), kv) for name, kv in named)
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
        model_overrides=overrides, sweep=sweep, plans=plans, method_settings=method_settings,
        warmup_pass_steps=data.get("warmup_pass_steps"), reference=data.get("reference"), source=source,
        named=frozenset(settings),
    )


def resolve_matrix_path(name_or_path: str) -> Path:
    """A matrix file by path, or by name: `NAME` is `matrices/NAME.yaml` in the current folder where that exists,
    else the matrix of that name shipped with Poros.

    Raises:
        ConfigError: naming what was looked for and the matrices known by name.
    """
    from poros.paths import unreadable

    p = Path(name_or_path)
    if p.is_file():
        return p
    why = unreadable(p)
    if why:
        raise ConfigError([f"matrix {name_or_path!r} {why}; pass a matrix file (YAML) or a name"], "matrix")
    for candidate in (Path("matrices") / f"{name_or_path}.yaml", MATRICES / f"{name_or_path}.yaml"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted({x.stem for x in MATRICES.glob("*.yaml")} | {x.stem for x in Path("matrices").glob("*.yaml")}))
    raise ConfigError([f"matrix {name_or_path!r} is neither a file nor one of: {known}"], "matrix")


def load_matrix(name_or_path: str) -> Matrix:
    """Load and validate a matrix by name (`cpu`) or path (`matrices/cpu.yaml`)."""
    path = resolve_matrix_path(name_or_path)
    try:
        data = load_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError([f"not valid YAML: {str(e).splitlines()[0]}"], str(path)) from None
    return parse_matrix(data, str(path))
