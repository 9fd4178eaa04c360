"""The run file, `key=value` overrides, the defaults a run takes on CUDA (tested as resolved configs, on
the CPU), the plan line, and the resolved configuration's round trip."""

from __future__ import annotations

from poros.sizes import format_size

import pytest

from poros.config import Method
from poros.engine.planning.geometry import Geometry
from poros.engine.planning.budget import make_plan
from poros.errors import ConfigError
from poros.finetune.config import (dump_run_file, override_words, parse_overrides, read_run_file,
                                   resolve)
from poros.finetune.plan_line import plan_line
from poros.models.checkpoint import resolve as resolve_model
from poros.choices import Attention, Device
from poros.resolve import DEVICE_DEFAULTS

BASE = {"model": "tiny-qwen2", "data": "data.jsonl", "out": "runs/a", "steps": 10}


def _problems(excinfo) -> str:
    return str(excinfo.value)


def test_yaml_numbers_read_as_numbers_and_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny-qwen2\ndata: data.jsonl\nout: runs/a\nsteps: 10\nlr: 1e-4\nseq_len: 64\n"
                    "lora_targets: [q_proj, v_proj]\nvram_budget: 24GB\n")
    values = read_run_file(path)
    assert values["lr"] == 1e-4 and isinstance(values["lr"], float)
    values.update(parse_overrides(["lr=2e-4", "lora-rank=8", "deterministic=true", "steps=20"]))
    fc, chosen = resolve(values, cuda_available=False)
    assert fc.train.lr == 2e-4 and fc.train.lora_rank == 8 and fc.train.deterministic is True and fc.steps == 20
    assert fc.train.lora_targets == ("q_proj", "v_proj") and fc.train.vram_budget == 24_000_000_000
    assert fc.train.device is Device.CPU and chosen == ("overlap_backward",)  # the CPU runs the backward serially


def test_unknown_and_missing_keys_are_listed_at_once_with_the_nearest_name():
    with pytest.raises(ConfigError) as e:
        resolve({"model": "tiny-qwen2", "learning_rate": 1e-4, "sequence_len": 64, "bogus": 1}, cuda_available=False)
    text = _problems(e)
    assert "learning_rate: not a setting of poros train" in text
    assert "sequence_len: not a setting of poros train (did you mean seq_len?)" in text
    assert "bogus: not a setting" in text
    assert "missing data, out, steps: give them in the run file (--config) or as --data, --out, --steps" in text


def test_invalid_values_are_listed_at_once():
    with pytest.raises(ConfigError) as e:
        resolve({**BASE, "lr": "fast", "seq_len": 0, "steps": -1, "eval_split": 0.7}, cuda_available=False)
    text = _problems(e)
    for part in ("lr: expected a number > 0", "seq_len: expected an integer > 0", "steps: expected an integer > 0",
                 "eval_split: expected a share of the records above 0 and below 0.5"):
        assert part in text, text


def test_an_override_without_a_value_is_refused():
    with pytest.raises(ConfigError, match="'lr': expected key=value"):
        parse_overrides(["lr"])


@pytest.mark.parametrize("text,named", [
    ("- a\n- b\n", "expected a mapping of settings"),
    ("lr: [1, 2\n", "run.yaml:2: not YAML"),
    ("lr: 1e-4\nsteps: 10\nlr: 1e-3\n", r"run.yaml:3: not YAML \(key 'lr' is given on line 1 and again on line 3"),
    ("lora_targets: {q_proj: 1, q_proj: 2}\n", "key 'q_proj' is given on line 1 and again on line 1"),
], ids=["file=list", "file=broken", "file=key-twice", "file=nested-key-twice"])
def test_a_run_file_that_is_not_a_mapping_names_the_file(tmp_path, text, named):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        read_run_file(path)
    with pytest.raises(ConfigError, match="no such run file"):
        read_run_file(tmp_path / "none.yaml")


def test_yaml_keys_given_once_and_merge_keys_read_as_before():
    """Control of the key given twice: distinct keys, nested mappings and YAML merge keys (`<<`)."""
    from poros.common.yamlfile import load_yaml

    assert load_yaml("a: {b: 1, c: 2}\nd: &x {e: 1}\nf:\n  <<: *x\n  g: 2\n") == {
        "a": {"b": 1, "c": 2}, "d": {"e": 1}, "f": {"e": 1, "g": 2}}


# --- the defaults on a GPU ------------------------------------------------------------------------


def test_cuda_takes_the_fast_exact_path_when_nothing_is_set():
    fc, chosen = resolve(dict(BASE), cuda_available=True)
    cfg = fc.train
    assert cfg.device is Device.CUDA
    assert (cfg.attention, cfg.deterministic, cfg.cuda_graphs, cfg.vram_budget) == (Attention.FAST, True, True, "auto")
    assert chosen == tuple(DEVICE_DEFAULTS[Device.CUDA])
    # each setting given keeps its value; the others still take the GPU's defaults
    fc, chosen = resolve({**BASE, "vram_budget": "24GB", "attention": "math"}, cuda_available=True)
    assert fc.train.vram_budget == 24_000_000_000 and fc.train.attention is Attention.MATH
    assert fc.train.cuda_graphs is True and fc.train.deterministic is True
    assert chosen == ("deterministic", "cuda_graphs", "keep_activations", "placement")
    fc, chosen = resolve({**BASE, "cuda_graphs": False, "deterministic": False}, cuda_available=True)
    assert (fc.train.cuda_graphs, fc.train.deterministic) == (False, False)


def test_the_cpu_keeps_the_table_defaults_but_runs_the_backward_serially():
    for values, cuda in ((dict(BASE), False), ({**BASE, "device": "cpu"}, True)):
        fc, chosen = resolve(values, cuda_available=cuda)
        cfg = fc.train
        assert cfg.device is Device.CPU and chosen == ("overlap_backward",) and cfg.overlap_backward is False
        assert (cfg.attention, cfg.deterministic, cfg.cuda_graphs, cfg.vram_budget) == (Attention.DEFAULT, False,
                                                                                         False, None)
    fc, chosen = resolve({**BASE, "overlap_backward": True}, cuda_available=False)  # control: given, kept
    assert fc.train.overlap_backward is True and chosen == ()


def test_the_plan_line_names_the_plan_and_the_defaults_it_took():
    # on cuda a budget holds the process: the CUDA context and the allocator's reserve beside the tensors
    fc, chosen = resolve({**BASE, "vram_budget": "908MB", "seq_len": 64}, cuda_available=True)
    source = resolve_model("tiny-qwen2")
    plan = make_plan(Geometry.of_config("tiny-qwen2", source.config, fc.train.lora_targets), fc.train)
    line = plan_line(fc, plan, chosen)
    assert "\n" not in line and line.startswith("plan: poros on cuda; attention fast (deterministic); 5 layers: ")
    assert plan.resident_layers and plan.streamed_layers, "a plan that keeps some layers and streams others"
    assert (f"{len(plan.resident_layers)} resident, {len(plan.streamed_layers)} streamed in blocks of "
            f"{plan.block_size}, predicted peak") in line
    assert f"(budget {format_size(plan.budget)})" in line and "CUDA-graph layers" in line
    assert line.endswith("defaults for cuda: attention, deterministic, cuda_graphs, keep_activations, placement (set "
                         "one to change it)")
    assert "activations kept" not in line  # layers stream: none kept
    assert "in host memory" not in line
    split = make_plan(Geometry.of_config("tiny-qwen2", source.config, fc.train.lora_targets),
                      fc.train.replace(offload_inputs=True, device_inputs=2))
    assert "saved inputs of 3 layers in host memory (" in plan_line(fc, split, chosen)
    assert ", 2 on the device; CUDA-graph layers" in plan_line(fc, split, chosen)
    fc, chosen = resolve({**BASE, "method": "resident"}, cuda_available=True)
    assert plan_line(fc, None, chosen).startswith("plan: resident on cuda; attention fast (deterministic); defaults")
    fc, _ = resolve(dict(BASE), cuda_available=True)
    assert "vram_budget auto (planned from the free device memory at the start)" in plan_line(fc, None)


# --- the resolved configuration -------------------------------------------------------------------


def test_the_resolved_configuration_reads_back_as_the_same_run(tmp_path):
    paths = {k: str(tmp_path / k) for k in ("model", "data", "out")}
    fc, _ = resolve({**BASE, **paths, "lr": 1e-5, "lora_targets": "q_proj,o_proj", "vram_budget": "300MB",
                     "method": "resident", "eval_split": 0.02, "seed": 2**32 - 1}, cuda_available=True)
    path = tmp_path / "run.yaml"
    path.write_text(dump_run_file(fc))
    again, chosen = resolve(read_run_file(path), cuda_available=False)
    assert again == fc and chosen == ()
    assert again.method is Method.RESIDENT and again.train.lr == 1e-5
    words, _ = resolve(parse_overrides(override_words(fc)), cuda_available=False)
    assert words == fc
    # control: a changed value reads back as another run
    path.write_text(dump_run_file(fc).replace("lr: 1e-05", "lr: 2e-05"))
    assert resolve(read_run_file(path), cuda_available=False)[0] != fc
