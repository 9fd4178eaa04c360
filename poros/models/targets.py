"""Which linears of a model's decoder layers carry LoRA adapters.

`lora_targets` names modules by their last name. Some architectures fuse projections into one
linear (Phi-3's `qkv_proj` and `gate_up_proj`): the default targets, which name the separate
projections, then also take the fused linears that hold them, so no projection goes without an
adapter unsaid. Targets given explicitly are taken as they are, but each must name a linear of
the model, and a fused linear whose parts are named must be named too.
"""

from __future__ import annotations

from poros.errors import ConfigError
from poros.models.skeleton import decoder_layers, layer_linears, skeleton
from poros.settings import LORA_TARGETS

FUSED = {  # a fused linear -> the separate projections it holds
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def layer_linear_names(config) -> list[str]:
    """The last names of the linears in the model's decoder layers, in module order, once each."""
    list_name, layers = decoder_layers(skeleton(config))
    names = []
    for i, layer in enumerate(layers):
        for full, _ in layer_linears(layer, f"{list_name}.{i}"):
            if full.rsplit(".", 1)[-1] not in names:
                names.append(full.rsplit(".", 1)[-1])
    return names


def resolve_targets(names: list[str], targets: tuple[str, ...], model: str = "the model") -> tuple[str, ...]:
    """The targets a run uses on `model`, whose layers hold linears `names` (see the module docstring).

    Raises:
        ConfigError: an explicit target names no linear of the model, or leaves a fused linear whose
            parts it names without an adapter.
    """
    targets = tuple(targets)
    if targets == LORA_TARGETS:
        fused = tuple(f for f, parts in FUSED.items() if f in names and set(parts) & set(targets))
        return targets + fused
    problems = []
    missing = [t for t in targets if t not in names]
    if missing:
        problems.append(f"{', '.join(missing)} is no linear of {model}'s decoder layers "
                        f"(they have {', '.join(sorted(names))})")
    for f, parts in FUSED.items():
        named = [p for p in parts if p in targets]
        if f in names and named and f not in targets:
            problems.append(f"{model} fuses {', '.join(parts)} into {f}: name {f} instead of {', '.join(named)}")
    if problems:
        raise ConfigError(problems, "lora_targets")
    return targets


def describe_targets(names: list[str], targets: tuple[str, ...]) -> str:
    """Which of the layers' linears `names` carry adapters and which do not, in one line."""
    on = [n for n in names if n in targets]
    off = [n for n in names if n not in targets]
    return f"LoRA adapters on {', '.join(on)}" + (f"; none on {', '.join(off)}" if off else "")
