"""The settings' one resolution (poros/resolve.py): the device's defaults, the rules that refuse combinations, and
every reader of them (TrainConfig, `poros train`, the CLI's flags, the matrix loader) taking them from there."""

from __future__ import annotations

import argparse
import re

import pytest

from poros.choices import Attention, Device
from poros.config import TrainConfig
from poros.errors import ConfigError
from poros.finetune.config import resolve as resolve_run
from poros.harness.cells import cell_config, matrix_cells, settings_line
from poros.harness.matrix import parse_matrix
from poros.resolve import DEVICE_DEFAULTS, RULES, problems, with_defaults
from poros.cli.flags import add_arguments

RUN = {"model": "tiny-qwen2", "data": "data.jsonl", "out": "runs/a", "steps": 10}


def _flags() -> set[str]:
    """Every flag `poros train` takes (the settings table's, with their --no- forms)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {o for a in parser._actions for o in a.option_strings}


def _unknown_flags(text: str, flags: set[str]) -> list[str]:
    return [f for f in re.findall(r"--[a-z][a-z-]*[a-z]", text) if f not in flags]


def test_every_refusal_names_flags_that_exist():
    flags = _flags()
    assert "--no-cuda-graphs" in flags and "--no-deterministic" in flags  # on by default on CUDA: a way to turn off
    assert "--no-keep-activations" in flags  # auto on CUDA beside a budget
    cfg = TrainConfig(model="m", device="cuda", cuda_graphs=True, compile=True)
    seen = 0
    for rule in RULES:  # each rule's line, from a config made to break it wherever it reads cuda_graphs
        if "cuda_graphs" in rule.settings and "device" not in rule.settings:
            broken = {"input_stride": dict(input_stride=2), "compile_mlp": dict(compile_mlp=False),
                      "keep_attention": dict(keep_attention=True), "lora_dropout": dict(lora_dropout=0.1)}
            other = next(k for k in rule.settings if k != "cuda_graphs")
            view = type("View", (), {**vars(cfg), **broken[other]})
            line = rule.problem(view)
            assert "--no-cuda-graphs" in line and _unknown_flags(line, flags) == [], line
            seen += 1
    assert seen == 4
    # negative control: the check finds a flag that does not exist
    assert _unknown_flags("give --no-such-flag or --cuda-graphs", flags) == ["--no-such-flag"]


@pytest.mark.parametrize("given, off", [({"input_stride": 2}, "input_stride"), ({"lora_dropout": 0.1}, "lora_dropout"),
                                        ({"keep_attention": True}, "keep_attention"),
                                        ({"compile": True, "compile_mlp": False}, "compile_mlp")])
def test_a_device_default_steps_aside_for_a_setting_given_that_refuses_it(given, off):
    fc, chosen = resolve_run({**RUN, **given}, cuda_available=True)
    assert fc.train.cuda_graphs is False and "cuda_graphs" not in chosen
    assert fc.train.attention is Attention.FAST and "attention" in chosen  # the other defaults still apply
    # negative control: given both, the combination is refused, naming the flag that undoes it
    with pytest.raises(ConfigError, match="--no-cuda-graphs") as refused:
        resolve_run({**RUN, **given, "cuda_graphs": True}, cuda_available=True)
    assert off in str(refused.value)


def test_with_defaults_takes_a_given_none_as_given_and_leaves_what_it_is_told():
    values, chosen = with_defaults({"vram_budget": None}, Device.CUDA)
    assert values["vram_budget"] is None and "vram_budget" not in chosen and values["cuda_graphs"] is True
    values, chosen = with_defaults({}, Device.CUDA, leave=("vram_budget",))
    assert "vram_budget" not in values and chosen == ("attention", "deterministic", "cuda_graphs")  # no budget: no placement
    assert with_defaults({}, Device.CPU) == ({"device": Device.CPU, "overlap_backward": False}, ("overlap_backward",))
    assert tuple(with_defaults({}, "cuda")[1]) == tuple(DEVICE_DEFAULTS[Device.CUDA])


def test_the_config_checks_the_same_rules():
    with pytest.raises(ConfigError, match="lora_dropout: its masks"):
        TrainConfig(model="m", device="cuda", cuda_graphs=True, lora_dropout=0.1)
    assert problems(TrainConfig(model="m", device="cuda", cuda_graphs=True)) == []


MATRIX = {"name": "m", "steps": 2, "passes": 1, "dataset": "synthetic", "methods": ["poros", "resident"],
          "models": ["tiny-qwen2"], "stacks": ["current"], "device": "cuda", "seq_len": 64,
          "plans": {"streamed": {"vram_budget": "none"}, "budget": {"vram_budget": "1GB"}, "auto": {},
                    "kept": {"keep_attention": True}}}


def _configs(data) -> dict:
    m = parse_matrix(data)
    return {(c.method.value, c.plan): cell_config(m, c) for c in matrix_cells(m) if c.method}, m


def test_a_cuda_matrix_runs_poros_on_the_device_defaults_unless_it_names_another():
    cfgs, m = _configs(MATRIX)
    streamed, auto, kept = cfgs["poros", "streamed"], cfgs["poros", "auto"], cfgs["poros", "kept"]
    assert streamed.cuda_graphs is True and streamed.vram_budget is None  # named none: every layer streamed
    assert auto.vram_budget == "auto" and cfgs["poros", "budget"].vram_budget == 10**9
    assert kept.cuda_graphs is False  # the default steps aside for keep_attention
    assert all(c.attention is Attention.FAST and c.deterministic for c in cfgs.values())  # every method alike
    resident = cfgs["resident", None]
    assert resident.vram_budget is None and resident.cuda_graphs is False  # schedule defaults are poros's alone
    assert "cuda_graphs on (cuda default)" in settings_line(m, next(c for c in matrix_cells(m) if c.plan == "streamed"))
    # negative controls: a matrix that names the settings keeps them; a CPU matrix takes no device default
    named, _ = _configs({**MATRIX, "cuda_graphs": False, "attention": "math", "plans": {"streamed": {}}})
    assert named["poros", "streamed"].cuda_graphs is False and named["poros", "streamed"].attention is Attention.MATH
    cpu, _ = _configs({**MATRIX, "device": "cpu", "plans": {"streamed": {}}})
    assert cpu["poros", "streamed"].cuda_graphs is False and cpu["poros", "streamed"].attention is Attention.DEFAULT


def test_a_matrix_reads_its_references_first():
    m = parse_matrix({**MATRIX, "methods": ["poros", "resident"]})
    assert [c.method.value if c.method else "gate" for c in matrix_cells(m)][:3] == ["gate", "resident", "poros"]


def test_the_backward_overlaps_as_one_property_says():
    """The planner and the executor read one derived fact: a worker thread overlaps the recompute unless layer
    templates replay the backward. Controls: each input alone turns it off."""
    base = TrainConfig(model="tiny-qwen2")
    assert base.backward_overlaps
    assert not base.replace(overlap_backward=False).backward_overlaps
    assert not base.replace(cuda_graphs=True, device="cuda").backward_overlaps


def test_a_budget_on_cuda_spreads_its_streamed_layers_unless_told_otherwise():
    """The fastest exact path places a budget's streamed layers among its resident ones on CUDA (a lower schedule
    floor at every budget, and measured faster: results/h100-fastest); a matrix or run that names tail keeps tail.
    Control: the CPU keeps the table's default, and a given placement is never replaced."""
    from poros.choices import Placement

    fc, chosen = resolve_run({**RUN, "vram_budget": "12GB"}, cuda_available=True)
    assert fc.train.placement is Placement.SPREAD and "placement" in chosen
    fc, chosen = resolve_run({**RUN, "vram_budget": "12GB", "placement": "tail"}, cuda_available=True)
    assert fc.train.placement is Placement.TAIL and "placement" not in chosen
    assert resolve_run({**RUN, "vram_budget": "12GB"}, cuda_available=False)[0].train.placement is Placement.TAIL
    m = parse_matrix({"name": "t", "steps": 1, "passes": 1, "warmup_passes": 0, "seq_len": 64, "batch_size": 1,
                      "grad_accum": 1, "lora_rank": 4, "lora_alpha": 8, "block_size": 2, "dataset": "synthetic",
                      "device": "cuda", "stacks": ["current"], "methods": ["poros"], "models": ["tiny-qwen2"],
                      "plans": {"12GB": {"vram_budget": "12GB"}, "12GB+tail": {"vram_budget": "12GB",
                                                                            "placement": "tail"}}})
    placed = {c.plan: cell_config(m, c).placement for c in matrix_cells(m) if c.plan}
    assert placed == {"12GB": Placement.SPREAD, "12GB+tail": Placement.TAIL}


def test_without_a_budget_a_run_keeps_the_table_placement():
    """`vram_budget: none` streams every layer: no resident layer to place, so the CUDA default of placement does not
    apply and such a run's settings (and its rows' fingerprints) stay those it had. Control: `auto` (the CUDA
    default budget) and a size take it."""
    from poros.choices import Placement
    from poros.sizes import AUTO

    values, chosen = with_defaults({"vram_budget": None}, Device.CUDA)
    assert "placement" not in values and "placement" not in chosen
    for budget in (AUTO, "12GB"):
        values, chosen = with_defaults({"vram_budget": budget}, Device.CUDA)
        assert values["placement"] is Placement.SPREAD and "placement" in chosen
    values, chosen = with_defaults({}, Device.CUDA)  # the budget's own default, auto, comes first
    assert values["placement"] is Placement.SPREAD


def test_a_budget_on_cuda_keeps_activations_where_it_holds_every_layer_unless_told_otherwise():
    """The fastest exact path: where a budget keeps every layer resident, their activations stay from forward to
    backward as far as the budget holds them (`keep_activations: auto`; results/h200-fastest compares it with
    recomputing them). Controls: a run that names it keeps its value, `--no-keep-activations` turns it
    off, the CPU keeps the table's default, and a run that streams every layer (`vram_budget: none`) takes none."""
    fc, chosen = resolve_run({**RUN, "vram_budget": "12GB"}, cuda_available=True)
    assert fc.train.keep_activations == "auto" and "keep_activations" in chosen
    fc, chosen = resolve_run({**RUN, "keep_activations": False}, cuda_available=True)
    assert fc.train.keep_activations is False and "keep_activations" not in chosen
    assert resolve_run({**RUN, "vram_budget": "12GB"}, cuda_available=False)[0].train.keep_activations is False
    values, chosen = with_defaults({"vram_budget": None}, Device.CUDA)
    assert "keep_activations" not in values and "keep_activations" not in chosen
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--no-keep-activations"]).keep_activations is False
    assert parser.parse_args(["--keep-activations"]).keep_activations is True
    with pytest.raises(ConfigError, match="expected true, false or auto"):
        TrainConfig(model="m", keep_activations="sometimes")


def test_help_names_only_the_settings_that_can_refuse_a_device_default():
    """`--help` words each device default with the settings whose values make a rule refuse it, tried value by value
    (poros/resolve.py `default_text`), and where it applies only beside a budget, says so. Controls: cuda_graphs
    yields to four settings; keep_attention refuses attention fa4, never the fast default; kept_layers needs
    keep_activations on, which auto is."""
    from poros.resolve import default_text

    assert default_text("cuda_graphs") == ("on with cuda unless a setting given refuses it (compile_mlp, input_stride, "
                                           "keep_attention, lora_dropout); else off")
    assert default_text("attention") == "fast with cuda; else default"
    assert default_text("keep_activations") == "auto with cuda beside a vram_budget; else off"
    assert default_text("placement") == "spread with cuda beside a vram_budget; else tail"
    assert with_defaults({"keep_attention": True, "kept_layers": 3, "vram_budget": "12GB"}, Device.CUDA)[0][
        "keep_activations"] == "auto"
