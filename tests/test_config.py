"""`TrainConfig`: one field per row of the settings table, typed as the row's checker declares, frozen, and
validated once with every problem in one error."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing

import pytest

from poros.config import TrainConfig
from poros.errors import ConfigError
from poros.choices import Accumulation, Attention, Device, Placement
from poros.settings import SETTINGS


def holds(value, type_) -> bool:
    """Whether `value` is of `type_` (a class, a union, a Literal or tuple[X, ...]); a bool is no int."""
    origin = typing.get_origin(type_)
    if origin in (typing.Union, types.UnionType):
        return any(holds(value, t) for t in typing.get_args(type_))
    if origin is typing.Literal:
        return value in typing.get_args(type_)
    if origin is tuple:
        item = typing.get_args(type_)[0]
        return isinstance(value, tuple) and all(holds(v, item) for v in value)
    if type_ is type(None):
        return value is None
    if type_ in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, type_)


def test_holds_tells_types_apart():  # negative control for the checks below
    assert holds(24 * 10**9, int | typing.Literal["auto"] | None) and holds("auto", int | typing.Literal["auto"] | None)
    assert not holds("24GB", int | typing.Literal["auto"] | None)
    assert not holds(["q_proj"], tuple[str, ...]) and holds(("q_proj",), tuple[str, ...])
    assert not holds(True, int) and not holds("cuda", Device) and holds(Device.CUDA, Device)


def test_the_fields_are_the_settings_table():
    fields = dataclasses.fields(TrainConfig)
    assert [f.name for f in fields] == ["model"] + [s.name for s in SETTINGS]
    for f, s in zip(fields[1:], SETTINGS):
        assert f.type == s.type and f.default == s.default, s.name
        assert holds(s.default, s.type), f"{s.name}: default {s.default!r} is not a {s.type}"
    assert all(isinstance(s.type, type) and issubclass(s.type, enum.Enum) for s in SETTINGS
               if s.name in ("attention", "device", "placement", "accumulation", "lr_schedule", "lora_compute"))


GIVEN_AS_TEXT = dict(  # as flags and matrix files give them
    device="cuda", vram_budget="24GB", lora_targets="q_proj,v_proj", attention="fast", placement="spread",
    accumulation="micro", keep_activations=True, kept_layers="3", loss_chunk="1024", max_grad_norm="1.5",
    lr_schedule="cosine", decay_steps="100", lr=1, lora_compute="bf16")


def test_values_come_out_as_their_types():
    cfg = TrainConfig(model="qwen2.5-72b", **GIVEN_AS_TEXT)
    for s in SETTINGS:
        assert holds(getattr(cfg, s.name), s.type), f"{s.name}: {getattr(cfg, s.name)!r} is not a {s.type}"
    assert (cfg.vram_budget, cfg.lora_targets, cfg.kept_layers, cfg.lr) == (24 * 10**9, ("q_proj", "v_proj"), 3, 1.0)
    assert cfg.attention is Attention.FAST and cfg.placement is Placement.SPREAD
    assert cfg.accumulation is Accumulation.MICRO and cfg.device is Device.CUDA


def test_a_config_is_frozen_and_a_replacement_is_checked_again():
    cfg = TrainConfig(model="tiny-qwen2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_len = 64
    assert cfg.replace(seq_len=64).seq_len == 64 and cfg.seq_len == 512
    with pytest.raises(ConfigError, match="seq_len: expected an integer > 0, got 0"):
        cfg.replace(seq_len=0)


def test_every_problem_in_one_error():
    with pytest.raises(ConfigError) as refused:
        TrainConfig(model="", seq_len=0, attention="fastest", cuda_graphs=True, kept_layers=2, lora_dropout=0.1)
    named = [p.split(":", 1)[0] for p in refused.value.problems]
    assert named == ["model", "seq_len", "attention", "kept_layers", "cuda_graphs", "lora_dropout"], named
    # the accepted neighbour: the same settings made consistent
    TrainConfig(model="tiny-qwen2", seq_len=64, attention="fast", device="cuda", cuda_graphs=True,
                keep_activations=True, kept_layers=2)


def test_a_rule_over_several_settings_waits_for_each_to_be_valid():
    """kept_layers without keep_activations is one problem; an unreadable kept_layers is another, named alone."""
    with pytest.raises(ConfigError) as refused:
        TrainConfig(model="tiny-qwen2", kept_layers="three")
    assert len(refused.value.problems) == 1 and refused.value.problems[0].startswith("kept_layers: expected")
    with pytest.raises(ConfigError, match="needs keep_activations"):
        TrainConfig(model="tiny-qwen2", kept_layers=3)


def test_a_schedule_variant_is_checked_and_coerced():
    from poros.settings import schedule_variant

    got = schedule_variant("offload_inputs=true,block_size=1,vram_budget=24GB")
    assert got == {"offload_inputs": True, "block_size": 1, "vram_budget": 24 * 10**9}
    assert schedule_variant("") == {}
    with pytest.raises(ValueError, match="'lr=1': expected KEY=VALUE with KEY one of"):
        schedule_variant("block_size=1,lr=1")  # lr is computed, not a schedule setting
    with pytest.raises(ValueError, match="block_size: expected"):
        schedule_variant("block_size=0")


def test_a_problem_quoting_a_huge_value_shows_its_start_and_length():
    from poros.harness.matrix import parse_matrix

    with pytest.raises(ConfigError) as refused:
        parse_matrix({"name": "x", "steps": 1, "passes": 1, "dataset": "synthetic", "methods": ["poros"],
                      "models": ["m" * 1_000_000], "stacks": ["current"]})
    problem = next(p for p in refused.value.problems if p.startswith("models:"))
    assert len(problem) < 500 and problem.endswith("more characters)"), problem[:600]
    with pytest.raises(ConfigError) as refused:  # negative control: a short value is quoted whole
        parse_matrix({"name": "x", "steps": 1, "passes": 1, "dataset": "synthetic", "methods": ["poros"],
                      "models": ["mmm"], "stacks": ["current"]})
    assert "unknown model 'mmm' (not registered" in str(refused.value)
