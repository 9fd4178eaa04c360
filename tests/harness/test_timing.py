"""Timed passes (poros/harness/timing.py): `measure` records the allocator's retries of each timed pass (not of the
warm-up; a resumed pass keeps its count) and `retries_per_step` averages them, saying nothing where a pass's count
is missing."""

from __future__ import annotations

import pytest


def test_rows_count_the_allocator_retries_of_the_timed_passes(monkeypatch):
    """Each timed pass records how often torch's allocator released its cache and tried again (a stall at a
    budget's cap); warm-up retries are not counted, a resumed pass keeps its count, and a row that misses
    a pass's count says nothing rather than a part."""
    from types import SimpleNamespace

    from poros.harness import timing

    count = iter(range(0, 1000, 3))  # each read of the counter: 3 retries since the last
    monkeypatch.setattr(timing, "alloc_retries", lambda device: next(count) if device == "cuda" else None)
    monkeypatch.setattr(timing, "_sync", lambda device: None)
    monkeypatch.setattr(timing, "_peaks", lambda device, nvml: dict.fromkeys(timing.PEAKS))
    trainer = SimpleNamespace(step=lambda: SimpleNamespace(counters={}, loss=0.0))
    cfg = SimpleNamespace(device=SimpleNamespace(value="cuda"))
    earlier = [{"seconds": 1.0, "counters": [], "alloc_retries": 10}]
    meas = timing.measure(trainer, cfg, steps=2, passes=3, warmup=1, earlier=earlier)
    assert meas.alloc_retries == [10, 3, 3]
    assert timing.retries_per_step(meas, steps=2) == pytest.approx(16 / 6)
    assert timing.retries_per_step(timing.Measurement([1.0, 1.0], alloc_retries=[2, None]), steps=1) is None
    assert timing.retries_per_step(timing.Measurement([1.0], alloc_retries=[]), steps=1) is None
    cpu = timing.measure(trainer, SimpleNamespace(device=SimpleNamespace(value="cpu")), steps=1, passes=1, warmup=0)
    assert cpu.alloc_retries == [None] and timing.retries_per_step(cpu, 1) is None


def test_each_pass_names_the_gpu_it_ran_on(monkeypatch):
    """A resumed cell keeps the GPU its earlier passes recorded and adds this process's to each pass it times
    (on a GPU its UUID, on the CPU none): a run in parts that changes machines shows in the row's pass_gpus."""
    from types import SimpleNamespace

    from poros.harness import timing

    monkeypatch.setattr(timing, "alloc_retries", lambda device: None)
    monkeypatch.setattr(timing, "_sync", lambda device: None)
    monkeypatch.setattr(timing, "_peaks", lambda device, nvml: dict.fromkeys(timing.PEAKS))
    monkeypatch.setattr(timing, "this_gpu_uuid", lambda: "GPU-this-part")
    trainer = SimpleNamespace(step=lambda: SimpleNamespace(counters={}, loss=0.0))
    seen = []
    earlier = [{"seconds": 1.0, "counters": [], "gpu": "GPU-earlier-part"}]
    meas = timing.measure(trainer, SimpleNamespace(device=SimpleNamespace(value="cuda")), steps=1, passes=3,
                          warmup=0, earlier=earlier, on_pass=seen.append)
    assert meas.pass_gpus == ["GPU-earlier-part", "GPU-this-part", "GPU-this-part"]
    assert [r["gpu"] for r in seen] == ["GPU-this-part"] * 2
    cpu = timing.measure(trainer, SimpleNamespace(device=SimpleNamespace(value="cpu")), steps=1, passes=1, warmup=0)
    assert cpu.pass_gpus == [None]


def test_each_pass_records_the_host_load_as_it_ended(monkeypatch):
    """A resumed cell keeps the load its earlier passes recorded and adds the host's 1-minute load average as each
    pass of this process ends; the row carries the busiest and the CPUs the process may use (what a page compares
    them with: poros/harness/report/tables.py `overloaded`)."""
    from types import SimpleNamespace

    from poros.harness import timing

    real = timing.host_load()
    assert isinstance(real, float) or real is None  # None where the platform has no load average
    loads = iter([0.5, 7.25])
    monkeypatch.setattr(timing, "host_load", lambda: next(loads))
    monkeypatch.setattr(timing, "_peaks", lambda device, nvml: dict.fromkeys(timing.PEAKS))
    trainer = SimpleNamespace(step=lambda: SimpleNamespace(counters={}, loss=0.0))
    seen = []
    meas = timing.measure(trainer, SimpleNamespace(device=SimpleNamespace(value="cpu")), steps=1, passes=3,
                          warmup=0, earlier=[{"seconds": 1.0, "counters": [], "load_avg": 3.0}], on_pass=seen.append)
    assert meas.pass_load == [3.0, 0.5, 7.25] and [r["load_avg"] for r in seen] == [0.5, 7.25]
    assert timing.usable_cores() >= 1


def test_within_a_pass_no_loss_is_read_of_the_step_just_enqueued(monkeypatch):
    """Reading a step's loss waits for its kernels: a progress line within a pass reads the step before the one just
    enqueued (the device stays busy with that one meanwhile), and only the pass's last step is read, after the
    pass's synchronization. Control: the fake trainer's record does see a read of the newest step where one is
    made (the pass's end)."""
    from types import SimpleNamespace

    from poros.harness import timing

    monkeypatch.setattr(timing, "alloc_retries", lambda device: None)
    monkeypatch.setattr(timing, "_peaks", lambda device, nvml: dict.fromkeys(timing.PEAKS))
    enqueued, synced, reads = [0], [0], []
    monkeypatch.setattr(timing, "_sync", lambda device: synced.__setitem__(0, enqueued[0]))

    class Result:
        def __init__(self, index):
            self.index, self.counters = index, {}

        @property
        def loss(self):
            # (step read, newest enqueued, whether a synchronization after that one came first)
            reads.append((self.index, enqueued[0], synced[0] == enqueued[0]))
            return 1.0

    def step():
        enqueued[0] += 1
        return Result(enqueued[0])

    timing.measure(SimpleNamespace(step=step), SimpleNamespace(device=SimpleNamespace(value="cuda")), steps=12,
                   passes=1, warmup=0)
    assert reads, "the pass printed no progress"
    newest = [(i, n, s) for i, n, s in reads if i == n]
    assert newest == [(12, 12, True)]  # the last step, after the pass's synchronization
    assert all(i < n for i, n, _ in reads if (i, n, _) not in newest) and len(reads) > 1
