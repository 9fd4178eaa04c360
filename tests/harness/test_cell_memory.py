"""What matrix cells keep between one another (poros/harness/cell_memory.py): a gate failure kept for every cell
that needs it holds none of the locals of its tracebacks' frames."""

from __future__ import annotations


def test_a_kept_gate_failure_holds_none_of_its_frames_locals():
    """A gate outcome that raised is kept for every cell that needs it; the trainer that failed (a local of
    a frame in its traceback, or in its cause's) must not stay on the device with it."""
    import gc
    import weakref

    from poros.harness.cell_memory import kept_failure

    class Trainer:
        pass

    refs = []

    def build():
        trainer = Trainer()
        refs.append(weakref.ref(trainer))
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise RuntimeError("out of memory") from inner

    def failure():
        try:
            build()
        except RuntimeError as e:
            return e

    held = failure()
    gc.collect()
    assert refs[0]() is not None  # negative control: the traceback holds the trainer
    assert kept_failure(held) is held and str(held) == "out of memory" and str(held.__cause__) == "inner"
    gc.collect()
    assert refs[0]() is None


def test_a_cell_records_what_earlier_cells_left_allocated(monkeypatch, capsys):
    """A cell's peaks include what earlier cells of the process left on the device; the row says how much
    (`held_before_gb`) and the console names it, so a peak above its plan's prediction is not read as the plan's."""
    import torch

    from poros.harness import cell_memory

    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: resets.append(1))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 4_290_000_000)
    assert cell_memory.held_before("cuda") == 4.29
    assert resets == [1]
    assert "4.29 GB of device memory is still allocated from earlier cells" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1_000_000)  # control: a stray MB goes unsaid
    assert cell_memory.held_before("cuda") == 0.001
    assert "still allocated" not in capsys.readouterr().err
    assert cell_memory.held_before("cpu") is None and len(resets) == 2  # off CUDA: nothing measured, nothing reset


def test_a_row_refuses_a_held_figure_that_is_not_one():
    from poros.harness.record_schema import ROW_FIELDS

    check = ROW_FIELDS["held_before_gb"]
    assert check(4.29) is None and check(None) is None
    assert check("4.29 GB") is not None and check(float("nan")) is not None


def test_between_cells_cublas_workspaces_are_given_back(monkeypatch):
    """cuBLAS's per-stream workspaces come from torch's allocator and outlive the trainer whose streams made them:
    freeing device memory between cells drops them before the cache is emptied, so the next cell's plan starts
    with none of them allocated."""
    import torch

    from poros.harness import cell_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cublas"), raising=False)
    cell_memory.free_device_memory()
    assert calls == ["cublas", "empty_cache"]  # dropped first: emptying the cache then returns their pages
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")  # a build without it: the cache alone
    calls.clear()
    cell_memory.free_device_memory()
    assert calls == ["empty_cache"]
