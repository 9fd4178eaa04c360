"""The cells of a matrix (poros/harness/matrix.py): per model × stack × sweep point the parity gate, then one
cell per method (poros once per plan), in the order that lets one store build serve them all; the settings
each cell and each gate runs with; and the declared gate that keeps full-size shapes off a CPU."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from poros.config import Method, TrainConfig
from poros.engine.methods.method_info import REFERENCES
from poros.engine.methods.registry import config_for, gate_of, gated
from poros.harness.matrix import Matrix, Stack
from poros.harness.results import point_id, show_value
from poros.models.shapes import SHAPES
from poros.choices import Device
from poros.resolve import DEVICE_DEFAULTS, with_defaults
from poros.settings import COMPUTED_NAMES, RUN, SCHEDULE, SCHEDULE_NAMES, SETTINGS


@dataclass(frozen=True)
class Cell:
    model: str
    stack: Stack
    method: Method | None  # None: the parity gate of this model × stack × sweep point
    point: tuple[tuple[str, object], ...] = ()  # the swept values of this cell
    plan: str | None = None  # poros's plan by name (None: the matrix's own schedule)

    @property
    def key(self) -> tuple:
        """What identifies the cell's row: `row_key` of the row it writes."""
        return (self.model, self.stack.name, self.method.value if self.method else "parity", self.plan,
                point_id(self.point))

    @property
    def gate_key(self) -> tuple:
        """The gate this cell belongs to: one reference per model, stack and sweep point."""
        return (self.model, self.stack.name, point_id(self.point))

    @property
    def id(self) -> str:
        """Reads like a report row and selects with -k: `model:qwen3-32b-stack:current-seq_len:512-method:poros-plan:24GB`."""
        parts = [f"model:{self.model}", f"stack:{self.stack.name}"]
        if self.point:
            parts.append(point_id(self.point))
        parts.append(f"method:{self.method.value}" if self.method else "gate:parity")
        if self.plan is not None:
            parts.append(f"plan:{self.plan}")
        return "-".join(parts)

    @property
    def label(self) -> str:
        """How the cell's console line names it, every part that tells it from its neighbours:
        `tiny-qwen2 seq_len=256 poros plan 24GB`, `qwen3-32b [torch212] parity gate`."""
        parts = [self.model, *([f"[{self.stack.name}]"] if self.stack.name != "current" else []),
                 *(f"{k}={show_value(v)}" for k, v in self.point),
                 self.method.value if self.method else "parity gate", *([f"plan {self.plan}"] if self.plan else [])]
        return " ".join(parts)


# What pytest's -k matches a cell's item against besides its own name (`_pytest.mark.KeywordMatcher.from_item`): the
# module the suites' items sit in (poros/suites/test_matrix.py; the package above it is the collection's root, left
# out) and the module's mark. `poros bench` selects cells by them before it runs pytest.
SUITE_KEYWORDS = ("test_matrix.py", "bench")


def keyword_names(cell: Cell) -> tuple[str, ...]:
    """The names a `-k` expression is matched against for `cell`: its item, `test_parity[ID]` or `test_step[ID]`,
    then the suites' own (`SUITE_KEYWORDS`)."""
    return (f"{'test_parity' if cell.method is None else 'test_step'}[{cell.id}]", *SUITE_KEYWORDS)


def matrix_cells(m: Matrix) -> list[Cell]:
    """Model by model, point by point: the parity gate, then each method (poros once per plan), so one
    store build serves them all; a reference method (resident QLoRA) before the others, so that a streamed row
    written after it carries its compute floor."""
    cells = []
    for model in m.models:
        for stack in m.stacks:
            for point in m.points():
                pt = tuple(point.items())
                if gated(m.methods):
                    cells.append(Cell(model, stack, None, pt))
                for meth in sorted(m.methods, key=lambda x: x.value not in REFERENCES):  # references first
                    plans = m.plan_names() if meth is Method.POROS else [None]
                    cells.extend(Cell(model, stack, meth, pt, plan) for plan in plans)
    return cells


def matrix_device(m: Matrix) -> str:
    if m.device is not None:
        return m.device.value
    return "cuda" if torch.cuda.is_available() else "cpu"


def train_config(m: Matrix, model: str, point=None, method: Method | None = None, plan: str | None = None) -> TrainConfig:
    """The settings a cell runs with (`Matrix.settings_for`)."""
    point = dict(point or ())
    device = matrix_device(m)
    return TrainConfig.from_settings(m.settings_for(model, point, method, plan, device), model=model, device=device)


def cell_config(m: Matrix, cell: Cell) -> TrainConfig:
    return train_config(m, cell.model, cell.point, cell.method, cell.plan)


def gate_config(m: Matrix, cell: Cell, plan: str | None = None) -> TrainConfig:
    """What a gate runs both sides with: the gated method's settings (and its plan)."""
    pair = gate_of(m.methods)
    return train_config(m, cell.model, cell.point, pair[1] if pair else None, plan)


def computed_of(cfg: TrainConfig) -> dict:
    """The computed settings of a config: runs that agree on them compute the same bits."""
    d = cfg.as_dict()
    return {k: d[k] for k in COMPUTED_NAMES if k in d}


CPU_PARAM_LIMIT = 2e9  # beyond this a CPU cell would run for hours: real shapes need a GPU


def model_unavailable(model: str, device: str) -> str | None:
    """Declared gate: full-size shapes are not run on a CPU (tiny ones and checkpoints are)."""

    shape = SHAPES.get(model)
    if device == "cpu" and shape is not None and (shape.published_params or 0) > CPU_PARAM_LIMIT:
        return f"{model} has {shape.published_params / 1e9:.1f}B parameters: run it on a GPU (device: cuda)"
    return None


def settings_line(m: Matrix, cell: Cell) -> str:
    """What a cell's method runs with, as `poros bench matrix` prints it before the run: every setting that differs
    from the table's default (RUN settings apart), those that took the device's default marked so."""
    cfg = config_for(cell.method, cell_config(m, cell))
    device = matrix_device(m)
    given = {**{k: m.settings[k] for k in m.named}, **dict(cell.point), **m.method_overrides(cell.method),
             **m.overrides_for(cell.model), **m.plan_settings(cell.plan)}
    _, chosen = with_defaults(given, device, leave=() if cell.method is Method.POROS else SCHEDULE_NAMES)
    shown = []
    for s in SETTINGS:
        if s.kind == RUN or (s.kind == SCHEDULE and cell.method is not Method.POROS):
            continue
        v = getattr(cfg, s.name)
        took = s.name in chosen and v == DEVICE_DEFAULTS[Device(device)][s.name]
        if v != s.default or took:
            shown.append(f"{s.name} {s.show(v)}" + (f" ({device} default)" if took else ""))
    plan = f" (plan {cell.plan})" if cell.plan else ""
    return f"  {cell.method.value}{plan}: " + (", ".join(shown) or "the table's defaults")


def fingerprint(*parts) -> str:
    """What a cell or gate runs with, hashed: passes and gate outcomes recorded under another are never reused."""
    text = json.dumps(parts, sort_keys=True, default=lambda v: getattr(v, "value", str(v)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cell_fingerprint(m: Matrix, cell: Cell) -> str:
    """The fingerprint of a timed cell's passes in the pass log: its matrix, settings and steps per pass."""
    from poros.engine.methods.registry import config_for

    return fingerprint(m.name, config_for(cell.method, cell_config(m, cell)).as_dict(), m.steps)


def gate_fingerprint(m: Matrix, cell: Cell, plan: str | None, parity_steps: int) -> str:
    """The fingerprint of a gate's outcome for `plan` in the pass log."""
    return fingerprint(m.name, gate_config(m, cell, plan).as_dict(), parity_steps)


def reference_fingerprint(m: Matrix, cfg: TrainConfig, parity_steps: int, reference: Method) -> str:
    """The fingerprint of a gate's reference side kept as digests (gate-references/NAME.json.gz)."""
    return fingerprint(m.name, cfg.as_dict(), parity_steps, reference.value)
