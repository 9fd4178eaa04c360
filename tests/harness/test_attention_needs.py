"""An attention value's declared needs (poros/choices.py `ATTENTION_NEEDS`: `fa4` needs device cuda, a GPU of compute
capability 9.x to 11.x and flash_attn.cute importable), refused before any work in one line that names what it
needs and the value to use instead: by the config rule wherever a config is made (train, plan, parity, a matrix
that `poros validate` or `poros bench` loads), and by the host check where a run starts on this machine. Each
refusal has its control: the same command with `fast`, or the host that has what it needs, goes on."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from poros.choices import ATTENTION_NEEDS, Attention
from poros.cli import main
from poros.config import TrainConfig
from poros.errors import CapabilityError, ConfigError
from poros.harness import preflight
from poros.harness.matrix import parse_matrix
from tests.fixtures import TINY_MATRIX, one_line_refusal, tiny_matrix

NEEDS = ("attention: fa4", "device cuda", "compute capability 9.x", "flash-attn-4==4.0.0b40",
         "use attention fast (--attention fast)")
TINY, _matrix = TINY_MATRIX, tiny_matrix


def test_a_config_on_the_cpu_refuses_fa4_and_takes_fast():
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen2", attention="fa4", device="cpu")
    assert len(e.value.problems) == 1 and all(part in e.value.problems[0] for part in NEEDS), e.value.problems
    assert TrainConfig(model="tiny-qwen2", attention="fast", device="cpu").attention is Attention.FAST
    assert TrainConfig(model="tiny-qwen2", attention="fa4", device="cuda").attention is Attention.FA4


def test_fa4_refuses_keep_attention():
    """keep_attention keeps what SDPA's fused ops return; FA4's calls are other ops."""
    with pytest.raises(ConfigError, match=r"keep_attention: .* attention fa4 runs other kernels; give "
                                          r"--no-keep-attention \(keep_attention: false\) or attention fast"):
        TrainConfig(model="tiny-qwen2", attention="fa4", device="cuda", keep_attention=True)
    TrainConfig(model="tiny-qwen2", attention="fast", device="cuda", keep_attention=True)


@pytest.mark.parametrize("argv", [
    ["train", "--model", "tiny-qwen2", "--data", "missing.jsonl", "--out", "run", "--steps", "2", "--device", "cpu"],
    ["plan", "--model", "tiny-qwen2", "--seq-len", "64", "--device", "cpu"],
    ["parity", "--model", "tiny-qwen2", "--seq-len", "64", "--steps", "1", "--device", "cpu"],
], ids=["train", "plan", "parity"])
def test_each_command_refuses_fa4_on_the_cpu_before_any_work(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    line = one_line_refusal(capsys, main([*argv, "--attention", "fa4"]), *NEEDS)
    assert line.startswith(f"poros {argv[0]}: error: ") and not (tmp_path / "run").exists()
    code = main([*argv, "--attention", "fast"])  # the control: past the attention check
    out, err = capsys.readouterr()
    assert "attention" not in err, err
    if argv[0] == "train":  # to the next check: a registered shape has no checkpoint to train
        assert code == 2 and "--model: tiny-qwen2 is a registered shape" in err, err
    else:
        assert code == 0, err


def test_a_plan_for_a_gpu_is_made_on_any_machine():
    """`poros plan` plans for CUDA from shapes alone (its default device): fa4's needs are the run's, not the plan's."""
    assert main(["plan", "--model", "qwen2.5-72b", "--seq-len", "4096", "--attention", "fa4"]) == 0


def test_validate_and_bench_refuse_a_cpu_matrix_on_fa4(capsys, tmp_path):
    bad = _matrix(tmp_path, attention="fa4", methods=["resident"])  # no poros cell: no plan checks it either
    assert main(["validate", bad]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {bad}:") and all(part in out for part in NEEDS), out
    one_line_refusal(capsys, main(["bench", "matrix", bad, "-o", str(tmp_path / "out")]), bad, *NEEDS)
    assert not (tmp_path / "out").exists()
    swept = _matrix(tmp_path, sweep={"attention": ["fast", "fa4"]})
    assert main(["validate", swept]) == 1 and "attention: fa4 runs" in capsys.readouterr().out
    good = _matrix(tmp_path, attention="fast", methods=["resident"])  # the control
    assert main(["validate", good]) == 0 and capsys.readouterr().out.startswith(f"ok   {good}")


def test_an_unsloth_cell_on_fa4_is_not_held_to_its_needs():
    """Unsloth keeps its own attention: its cells run fa4 as fast, so they ask nothing of the machine."""
    m = parse_matrix({**TINY, "device": "cuda", "attention": "fa4", "methods": ["unsloth"]})
    assert preflight.matrix_attention(m, "cuda") == set()
    m = parse_matrix({**TINY, "device": "cuda", "attention": "fa4", "methods": ["unsloth", "resident"]})
    assert preflight.matrix_attention(m, "cuda") == {Attention.FA4}


@pytest.fixture
def gpu(monkeypatch):
    """This machine as one with a CUDA GPU of `gpu.capability` (default 9.0, an H100)."""
    state = types.SimpleNamespace(capability=(9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: state.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    return state


def test_on_a_gpu_the_host_check_names_what_is_missing(gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed, whatever this machine has
    problem = preflight.attention_problem(Attention.FA4, "cuda")
    assert "attention: fa4 needs flash-attn-4==4.0.0b40 (import flash_attn.cute failed: ModuleNotFoundError" in problem
    assert "scripts/stage_fa4.sh" in problem and problem.endswith("or use attention fast (--attention fast)")
    gpu.capability = (8, 0)
    assert preflight.attention_problem(Attention.FA4, "cuda:0") == (
        "attention: fa4 needs a GPU of compute capability 9.x (Hopper), 10.x or 11.x (Blackwell data-center); "
        "NVIDIA H100 80GB HBM3 is 8.0: use attention fast (--attention fast)")
    gpu.capability = (12, 0)
    assert "is 12.0: use attention fast" in preflight.attention_problem(Attention.FA4, "cuda")
    with pytest.raises(CapabilityError, match=r"^m.yaml: attention: fa4 needs a GPU"):
        preflight.check_attention("fa4", "cuda", "m.yaml")


def test_on_a_gpu_that_has_it_the_host_check_passes(gpu, monkeypatch):
    """The control: compute capability 9.0 and the module importable (a stand-in module here)."""
    monkeypatch.setitem(ATTENTION_NEEDS, Attention.FA4, dataclasses.replace(ATTENTION_NEEDS[Attention.FA4],
                                                                            module="json"))
    assert preflight.attention_problem(Attention.FA4, "cuda") is None
    gpu.capability = (10, 3)  # a B300
    assert preflight.attention_problem("fa4", "cuda") is None
    assert preflight.attention_problem(Attention.FAST, "cpu") is None  # values without needs: none asked


def test_without_a_gpu_the_host_check_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert preflight.attention_problem(Attention.FA4, "cuda") == (
        "attention: fa4 needs a CUDA GPU and torch finds none here; use attention fast (--attention fast)")
    assert "got device 'cpu'" in preflight.attention_problem(Attention.FA4, "cpu")
