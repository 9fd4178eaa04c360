"""How a run's settings resolve, in one step and one place: the settings given (flags, a run file, a matrix's keys),
then the defaults of the device the run is on (`DEVICE_DEFAULTS`: the fastest exact path), then the settings
table's defaults (poros/settings.py); and the rules by which two settings cannot combine (`RULES`), which
`TrainConfig` checks, so the CLI, the matrix loader, `poros train` and the executor all read them from here.

A device default steps aside where a rule would refuse it beside the settings given: `--lora-dropout 0.1` on CUDA
runs without CUDA-graph layers instead of being refused over a setting nobody gave. A setting given that breaks a
rule is refused, naming the flag (and matrix key) that undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from poros.choices import ATTENTION_NEEDS, Attention, Device, LRSchedule, Placement
from poros.settings import BY_NAME, SETTINGS, check_values
from poros.sizes import AUTO

# The fastest exact path on each device: what a setting left unset takes there, before the table's default.
# On CUDA: flash-or-efficient attention under strict determinism (exact and repeatable), each layer replayed from
# a CUDA graph (one launch a layer instead of hundreds), as many layers resident as the card's free memory holds,
# and where a budget keeps only some, the streamed layers spread among them: each copy then runs behind resident
# layers' forward as well as their backward, where the tail placement leaves the link idle while the last layers
# compute (at the budgets of the fastest-path matrices the schedule floor of poros/engine/planning/timeline.py is
# lower spread; results/h100-fastest compares the two); and where the budget keeps every layer resident, those
# layers keep their activations as far as the rest of it holds them instead of recomputing their forwards
# (results/h200-fastest compares the two). On the CPU the backward runs on the thread that enqueues the next
# recompute: there the overlapped backward's worker thread computes beside the recompute and only contends for the
# cores (results/cpu/README.md).
DEVICE_DEFAULTS: dict[Device, dict[str, object]] = {
    Device.CUDA: {"attention": Attention.FAST, "deterministic": True, "vram_budget": AUTO, "cuda_graphs": True,
                  "keep_activations": AUTO, "placement": Placement.SPREAD},
    Device.CPU: {"overlap_backward": False},
}


# A device default that matters only beside another setting applies only there: the placement of resident layers
# and whether they keep their activations only where a budget is asked for (`vram_budget` none streams every layer
# and leaves none resident), so such a run keeps the table's values and the settings it had before the defaults
# were added.
APPLIES: dict[str, Callable[[dict], bool]] = {"placement": lambda values: values.get("vram_budget") is not None,
                                              "keep_activations": lambda values: values.get("vram_budget") is not None}


def off(name: str) -> str:
    """How a user turns flag setting `name` off: its --no- flag and its matrix/run-file key."""
    return f"{BY_NAME[name].flag.replace('--', '--no-', 1)} ({name}: false)"


def attention_device_problem(attention: Attention, device: Device) -> str:
    """Why `attention` cannot run on `device` (its KernelNeeds, poros/choices.py), naming what to use instead."""
    needs = ATTENTION_NEEDS[attention]
    return (f"attention: {attention.value} runs the kernels of {needs.package}, which need device "
            f"{needs.device.value} and a GPU of {needs.least}; got device {device.value!r}: use attention "
            f"{needs.instead.value} (--attention {needs.instead.value}) here")


@dataclass(frozen=True)
class Rule:
    """Settings that constrain each other: `refuses(cfg)` is true for a combination that cannot run, and
    `problem(cfg)` says why in one line, naming how to undo it. `settings` are the names it reads: it is checked
    only where each of them passed its own check."""

    settings: tuple[str, ...]
    refuses: Callable[[object], bool]
    problem: Callable[[object], str]


RULES: tuple[Rule, ...] = (
    Rule(("kept_layers", "keep_activations"), lambda c: c.kept_layers is not None and not c.keep_activations,
         lambda c: f"kept_layers: counts the resident layers that keep their activations, so it needs "
                   f"keep_activations; got kept_layers={c.kept_layers} without it"),
    Rule(("device_inputs", "offload_inputs"), lambda c: c.device_inputs is not None and not c.offload_inputs,
         lambda c: f"device_inputs: counts the layers whose saved inputs stay on the device while the others go "
                   f"through host memory, so it needs offload_inputs; got device_inputs={c.device_inputs} without it"),
    Rule(("input_stride", "keep_attention"), lambda c: c.input_stride > 1 and c.keep_attention,
         lambda c: f"input_stride: a regenerated input has no attention results saved with it, so it needs "
                   f"keep_attention off; got input_stride={c.input_stride} with keep_attention"),
    Rule(("regenerated_layers", "input_stride"), lambda c: c.regenerated_layers is not None and c.input_stride == 1,
         lambda c: f"regenerated_layers: bounds the layers whose inputs input_stride regenerates, so it needs "
                   f"input_stride above 1; got regenerated_layers={c.regenerated_layers} with input_stride 1"),
    Rule(("input_stride", "cuda_graphs"), lambda c: c.input_stride > 1 and c.cuda_graphs,
         lambda c: f"input_stride: regenerates inputs with eager (or compiled) forwards, not through layer "
                   f"templates; give {off('cuda_graphs')} or drop input_stride, got input_stride={c.input_stride}"),
    Rule(("compile_mlp", "compile"), lambda c: not c.compile_mlp and not c.compile,
         lambda c: "compile_mlp: off leaves each decoder layer's MLP out of its compiled graph, so it needs compile "
                   "(--compile); got compile_mlp off without it"),
    Rule(("compile_mlp", "cuda_graphs"), lambda c: not c.compile_mlp and c.cuda_graphs,
         lambda c: f"compile_mlp: off is for layers run without CUDA graphs (layer templates compile each layer "
                   f"whole); give {off('cuda_graphs')} or drop compile_mlp off"),
    Rule(("cuda_graphs", "device"), lambda c: c.cuda_graphs and c.device is not Device.CUDA,
         lambda c: f"cuda_graphs: needs device cuda, got {c.device.value!r}"),
    Rule(("attention", "device"),
         lambda c: c.attention in ATTENTION_NEEDS and c.device is not ATTENTION_NEEDS[c.attention].device,
         lambda c: attention_device_problem(c.attention, c.device)),
    Rule(("keep_attention", "attention"), lambda c: c.keep_attention and c.attention in ATTENTION_NEEDS,
         lambda c: f"keep_attention: keeps what SDPA's fused kernels return, and attention {c.attention.value} runs "
                   f"other kernels; give {off('keep_attention')} or attention "
                   f"{ATTENTION_NEEDS[c.attention].instead.value}"),
    Rule(("shard_stream", "gpus"), lambda c: c.shard_stream and c.gpus < 2,
         lambda c: f"shard_stream: shares each streamed copy among data-parallel ranks, so it needs gpus > 1; got "
                   f"gpus={c.gpus}"),
    Rule(("keep_attention", "cuda_graphs"), lambda c: c.keep_attention and c.cuda_graphs,
         lambda c: f"keep_attention: hands attention's recorded results back at each call, which a replayed CUDA "
                   f"graph does not make; give {off('cuda_graphs')} or drop keep_attention"),
    Rule(("cuda_graphs", "lora_dropout"), lambda c: c.cuda_graphs and c.lora_dropout > 0,
         lambda c: f"lora_dropout: its masks are drawn per call, which a replayed CUDA graph does not do; give "
                   f"{off('cuda_graphs')} or drop lora_dropout, got lora_dropout={c.lora_dropout}"),
    Rule(("lr_schedule", "decay_steps"), lambda c: c.lr_schedule is LRSchedule.CONSTANT and c.decay_steps is not None,
         lambda c: f"decay_steps: only linear and cosine decay; got decay_steps={c.decay_steps} with lr_schedule "
                   "constant (leave it out, or pick linear or cosine)"),
    Rule(("lr_schedule", "decay_steps"), lambda c: c.lr_schedule is not LRSchedule.CONSTANT and c.decay_steps is None,
         lambda c: f"decay_steps: lr_schedule {c.lr_schedule.value} decays to 0 at decay_steps; give it (poros train "
                   "takes its --steps)"),
    Rule(("lr_schedule", "decay_steps", "warmup_steps"),
         lambda c: c.lr_schedule is not LRSchedule.CONSTANT and c.decay_steps is not None
         and c.warmup_steps >= c.decay_steps,
         lambda c: f"warmup_steps: expected fewer than decay_steps ({c.decay_steps}), got {c.warmup_steps}"),
)


def problems(cfg, valid: Callable[..., bool] = lambda *names: True) -> list[str]:
    """The rules `cfg` (a TrainConfig, or any object with the settings as attributes) breaks, among those whose
    settings `valid` says passed their own check."""
    return [r.problem(cfg) for r in RULES if valid(*r.settings) and r.refuses(cfg)]


def _device_of(value) -> Device | None:
    try:
        return Device(getattr(value, "value", value))
    except ValueError:
        return None


def with_defaults(given: dict, device=None, leave: tuple[str, ...] = ()) -> tuple[dict, tuple[str, ...]]:
    """`given` (setting names to values; a name present is given, None included: `vram_budget: none` streams every
    layer) with the defaults of `device` (default: the
    `device` among `given`) for every setting left unset but those in `leave`, each one unless a rule would refuse
    it beside what is given; the table's defaults stay for TrainConfig to fill.

    Returns:
        the settings to build the config from, and the names that took a device default, in the table's order.
    """
    values = dict(given)
    dev = _device_of(device if device is not None else values.get("device"))
    if dev is not None:
        values.setdefault("device", dev)
    defaults = DEVICE_DEFAULTS.get(dev, {})
    chosen = []
    for name in (s.name for s in SETTINGS if s.name in defaults and s.name not in values and s.name not in leave):
        if name in APPLIES and not APPLIES[name](values):  # vram_budget comes before placement in the table
            continue
        trial = {**values, name: defaults[name]}
        if not _refused(trial, name):
            values[name] = defaults[name]
            chosen.append(name)
    return values, tuple(chosen)


def _refused(values: dict, name: str) -> bool:
    """Whether a rule reading setting `name` refuses `values` (the table's defaults filling the rest); values that
    fail their own check are left to the config to name."""
    checked, bad = check_values({s.name: values[s.name] if values.get(s.name) is not None else s.default
                                 for s in SETTINGS})
    if bad:
        return False
    view = SimpleNamespace(**checked)
    return any(name in r.settings and r.refuses(view) for r in RULES)


def has_off_flag(name: str) -> bool:
    """Whether flag setting `name` has a --no- flag: it is on by default somewhere (the table's default or a
    device's, auto included)."""
    return bool(BY_NAME[name].default or any(d.get(name) for d in DEVICE_DEFAULTS.values()))


def default_text(name: str) -> str | None:
    """How --help words a setting's default where a device changes it (None: the table's default alone)."""
    per_device = [(d, v[name]) for d, v in DEVICE_DEFAULTS.items() if name in v]
    if not per_device:
        return None
    setting = BY_NAME[name]
    beside = " beside a vram_budget" if name in APPLIES else ""
    shown = ", ".join(f"{setting.show(v)} with {d.value}{beside}" for d, v in per_device)
    yields = sorted({o for d, v in per_device for r in RULES if name in r.settings for o in r.settings
                     if o not in (name, "device") and _may_refuse(name, v, o, d)})
    unless = f" unless a setting given refuses it ({', '.join(yields)})" if yields else ""
    return f"{shown}{unless}; else {setting.default_help or setting.show(setting.default)}"


def _may_refuse(name: str, default, other: str, device: Device) -> bool:
    """Whether some value of setting `other` given beside device default `default` of `name` makes a rule refuse
    it (tried: each value of an enum, true and false, a count of 2, a share of 0.1; the table's defaults elsewhere)."""
    check = BY_NAME[other].check
    members = list(getattr(check.type, "__members__", {}).values()) if isinstance(check.type, type) else []
    for value in members or [True, False, 2, 0.1]:
        if _refused({"device": device, name: default, other: value}, name):
            return True
    return False
