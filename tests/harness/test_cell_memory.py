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
