"""Deterministic mode: strict `torch.use_deterministic_algorithms` for every method alike, cuBLAS's
workspace configured before CUDA work, and a kernel strict mode refuses ending in one line; and on the CPU every
method's kernels on one thread."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from poros.config import Method, TrainConfig
from poros.errors import CapabilityError
from poros.engine.methods.registry import make_trainer
from poros.engine.methods.trainer import CUBLAS_WORKSPACE, deterministic_kernels, kernel_refusal

REPO = Path(__file__).resolve().parents[2]
IN_PROCESS = [Method.RESIDENT, Method.RESIDENT_GC, Method.POROS]
# PyTorch's refusal in strict mode (at::Context::alertNotDeterministic), for an op it has no deterministic kernel of
REFUSAL = ("scaled_dot_product_flash_attention_backward_cuda does not have a deterministic implementation, but you "
           "set 'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, "
           "or you can use the 'warn_only=True' option, if that's acceptable for your application.")


def _mode() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.fixture
def mode(monkeypatch):
    """Strict mode off and CUBLAS_WORKSPACE_CONFIG unset for the test; both restored after it, with PyTorch's
    filling of uninitialized memory."""
    before, fill = _mode(), torch.utils.deterministic.fill_uninitialized_memory
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _cfg(model: str = "tiny-qwen3", **kw) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, block_size=2, lr=1e-2, **kw)


@pytest.mark.parametrize("method", IN_PROCESS, ids=lambda m: f"method={m.value}")
def test_deterministic_turns_strict_mode_on(stores, mode, method):
    trainer = make_trainer(method, stores("tiny-qwen3"), _cfg(deterministic=True))
    try:
        assert _mode() == (True, False), f"{method.value}: (enabled, warn_only) = {_mode()}, expected strict"
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == CUBLAS_WORKSPACE
        assert trainer.step().loss > 0  # and it trains under it
    finally:
        trainer.close()


@pytest.fixture
def threads():
    """Torch's CPU thread count restored after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("method", IN_PROCESS, ids=lambda m: f"method={m.value}")
def test_a_cpu_trainer_runs_torch_on_one_thread(stores, threads, method):
    torch.set_num_threads(2)  # what the process had before: more than one
    trainer = make_trainer(method, stores("tiny-qwen3"), _cfg())
    try:
        assert torch.get_num_threads() == 1, f"{method.value}: {torch.get_num_threads()} threads on the CPU"
    finally:
        trainer.close()


@pytest.mark.parametrize("method", IN_PROCESS, ids=lambda m: f"method={m.value}")
def test_without_deterministic_the_mode_is_left_as_it_was(stores, mode, method):
    """Off stays off, and a mode set by someone else (here warn-only) is not touched either."""
    for state in ((False, False), (True, True)):
        torch.use_deterministic_algorithms(state[0], warn_only=state[1])
        make_trainer(method, stores("tiny-qwen3"), _cfg()).close()
        assert _mode() == state, f"{method.value} changed the mode {state} to {_mode()}"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def _resident_step(store, fill: bool) -> dict[str, torch.Tensor]:
    """One resident step under strict mode with PyTorch's NaN fill of uninitialized memory on or off: the loss
    and the LoRA weights after the optimizer's step (with their gradients where the step keeps them)."""
    trainer = make_trainer(Method.RESIDENT, store, _cfg(deterministic=True))
    try:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        loss = trainer.step().loss
        out = {"loss": torch.tensor(loss)}
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:
                out[name] = p.detach().clone()
                if p.grad is not None:
                    out[name + ".grad"] = p.grad.detach().clone()
        return out
    finally:
        trainer.close()


def test_filling_uninitialized_memory_changes_no_bit(stores, mode):
    """Strict mode leaves uninitialized memory unfilled: a training step reads only what it wrote, so its
    loss, gradients and weights are the same bits with PyTorch's NaN fill. Negative control: with the fill
    on, memory that is read before written is NaN, which any such read would carry into the results."""
    from poros.engine.methods.trainer import enable_determinism

    enable_determinism()
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    unfilled, filled = _resident_step(stores("tiny-qwen3"), False), _resident_step(stores("tiny-qwen3"), True)
    assert unfilled.keys() == filled.keys() and len(unfilled) > 1
    for name in unfilled:
        assert torch.equal(unfilled[name], filled[name]), name
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(64).isnan().all()


def test_gate_passes_under_strict_mode(stores, mode):
    from poros.engine.verify.parity import parity

    result = parity(_cfg("tiny-gemma3", grad_accum=2, deterministic=True), steps=2, store=stores("tiny-gemma3"))
    assert _mode() == (True, False)
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


class _RefusedBackward(torch.autograd.Function):
    """Identity forward whose backward raises what strict mode raises for a kernel without a deterministic
    variant (on CUDA: the flash-attention backward of older PyTorch)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(REFUSAL)


@pytest.fixture
def refusing_attention(monkeypatch):
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: _RefusedBackward.apply(real(*a, **k)))


def _assert_one_line(e: CapabilityError) -> None:
    text = str(e)
    assert "\n" not in text, text
    assert text.startswith("scaled_dot_product_flash_attention_backward_cuda has no deterministic implementation"), text
    assert "drop deterministic" in text and "another attention backend" in text, text
    assert e.__cause__ is None and e.__suppress_context__, "the RuntimeError's traceback is not the user's"


@pytest.mark.parametrize("method", IN_PROCESS, ids=lambda m: f"method={m.value}")
def test_refused_kernel_ends_in_one_line_naming_the_op(stores, mode, refusing_attention, method):
    """Poros's backward runs on a worker thread (overlap_backward): its error is converted all the same."""
    trainer = make_trainer(method, stores("tiny-qwen3"), _cfg(deterministic=True))
    try:
        with pytest.raises(CapabilityError) as e:
            trainer.step()
        _assert_one_line(e.value)
    finally:
        trainer.close()


def test_refused_kernel_in_the_gate_and_the_cli(stores, mode, refusing_attention, capsys):
    from poros.cli import main
    from poros.engine.verify.parity import parity

    with pytest.raises(CapabilityError) as e:
        parity(_cfg(deterministic=True), steps=1, store=stores("tiny-qwen3"))
    _assert_one_line(e.value)
    assert main(["parity", "--model", "tiny-qwen3", "--seq-len", "64", "--steps", "1", "--deterministic"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("poros parity: error: scaled_dot_product_flash_attention_backward_cuda has no "
                          "deterministic implementation") and "\n" not in err, err


def test_other_errors_pass_through_unchanged():
    """Negative control: only strict mode's refusals become CapabilityErrors."""
    boom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(RuntimeError) as e:
        with deterministic_kernels():
            raise boom
    assert e.value is boom and kernel_refusal(boom) is None
    with pytest.raises(ValueError):
        with deterministic_kernels():
            raise ValueError(REFUSAL)  # not a RuntimeError: not PyTorch's refusal


def test_cublas_refusal_says_to_set_the_variable():
    msg = ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
           "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because it "
           "uses CuBLAS and you have CUDA >= 10.2. To enable deterministic behavior in this case, you must set an "
           "environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8 or "
           "CUBLAS_WORKSPACE_CONFIG=:16:8.")
    e = kernel_refusal(RuntimeError(msg))
    assert isinstance(e, CapabilityError) and f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}" in str(e)
    assert "before the process starts" in str(e) and "\n" not in str(e)


def _record_env(monkeypatch, module: str) -> list:
    """Replace `poros.cli.<module>.run` by one that records CUBLAS_WORKSPACE_CONFIG when the command starts."""
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(f"poros.cli.{module}"), "run",
                        lambda args: seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG")) or 0)
    return seen


@pytest.mark.parametrize("flag", [True, False], ids=lambda f: f"deterministic={f}")
def test_cli_sets_cublas_workspace_before_the_command_runs(monkeypatch, mode, flag):
    from poros.cli import main

    seen = _record_env(monkeypatch, "parity")
    argv = ["parity", "--model", "tiny-qwen3"] + (["--deterministic"] if flag else [])
    assert main(argv) == 0
    assert seen == [CUBLAS_WORKSPACE if flag else None]


@pytest.mark.parametrize("flag", [True, False], ids=lambda f: f"deterministic={f}")
def test_cli_reads_the_matrix_before_a_bench_runs(tmp_path, monkeypatch, mode, flag):
    from poros.cli import main

    data = yaml.safe_load((REPO / "matrices" / "cpu.yaml").read_text())
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**data, "deterministic": flag}))
    seen = _record_env(monkeypatch, "bench")
    assert main(["bench", "matrix", str(path), "-o", str(tmp_path / "out")]) == 0
    assert seen == [CUBLAS_WORKSPACE if flag else None]


def test_matrix_suites_turn_strict_mode_on_first(tmp_path, mode):
    """poros/suites/plugin.py's session start: strict mode and the cuBLAS workspace before anything else runs."""
    spec = importlib.util.spec_from_file_location("suites_plugin", REPO / "poros" / "suites" / "plugin.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    data = yaml.safe_load((REPO / "matrices" / "cpu.yaml").read_text())
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({**data, "deterministic": True}))
    first = []

    def writer():  # the first thing the session start does after determinism
        first.append((_mode(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return SimpleNamespace(line=lambda msg: None, flush=lambda: None)

    options = {"--matrix": str(path), "--steps": None, "--passes": None}
    config = SimpleNamespace(getoption=options.get, get_terminal_writer=writer,
                             pluginmanager=SimpleNamespace(getplugin=lambda name: None))
    from poros.harness.console import set_progress_writer

    try:
        conftest.pytest_sessionstart(SimpleNamespace(config=config))
    except AttributeError:  # what follows needs a real pytest config; only what ran first matters here
        pass
    finally:
        set_progress_writer(None)
    assert first == [((True, False), CUBLAS_WORKSPACE)]
