"""A profiled step's summary (poros/harness/profiling.py), as scripts/profile_step.py and Unsloth's child
process write it."""

from __future__ import annotations

import pytest
import torch

from poros.harness.profiling import (
    _gaps_us,
    _overlap_us,
    _union_us,
    compute_waits,
    host_within,
    kind_of,
    link_idle,
    profiled,
    summarize,
)


def test_kernels_are_sorted_into_kinds_by_name():
    assert kind_of("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel") == "attention_backward"
    assert kind_of("void pytorch_flash::flash_fwd_kernel") == "attention_forward"
    assert kind_of("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "matmul"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert kind_of("kDequantizeBlockwise") == "nf4_dequantize"
    assert kind_of("void at::native::vectorized_elementwise_kernel") == "other"


def test_busy_time_counts_overlapping_intervals_once():
    assert _union_us([(0, 10), (5, 15), (20, 30)]) == 25
    assert _union_us([(0, 10), (2, 3)]) == 10


def test_idle_gaps_lie_between_busy_intervals_longest_first():
    assert _gaps_us([(20, 30), (0, 10), (5, 12), (31, 40)]) == [8, 1]
    assert _gaps_us([(0, 10), (2, 3)]) == []  # one nested in another: no gap


def test_the_link_idles_between_copies_with_the_compute_inside_counted():
    """Copies (0-10), (12-30), (30-40) within a step whose kernels run 5-20 and 38-50: the link idles 10-12 (the
    kernels busy all of it) and 40-50 (busy all of it); copies back to back leave no interval between them."""
    assert link_idle([(0, 10), (12, 30), (30, 40)], [(5, 20), (38, 50)]) == [(10, 12, 2), (40, 50, 10)]
    # a gap the kernels leave idle too: the host's time, none of it compute
    assert link_idle([(0, 10), (20, 30)], [(0, 5), (25, 30)]) == [(10, 20, 0)]
    # the step's span starts at its first kernel: a kernel before the first copy is link idle, with its compute
    assert link_idle([(10, 20)], [(0, 4)]) == [(0, 10, 4)]
    assert link_idle([], []) == []


def test_what_the_host_ran_while_the_link_idled():
    """The CPU operators overlapping an interval, by their time within it: one that ran 2 of its 5 ms inside counts
    2; one wholly outside does not appear."""
    cpu = [("Optimizer.step", 0, 5000), ("aten::copy_", 3000, 4000), ("aten::copy_", 4500, 9000),
           ("cudaEventSynchronize", 20000, 30000)]
    assert host_within((3000, 6000), cpu) == [["aten::copy_", 2.5], ["Optimizer.step", 2.0]]
    assert host_within((3000, 6000), cpu, top=1) == [["aten::copy_", 2.5]]
    assert host_within((10000, 12000), cpu) == []  # nothing ran on the host then


def test_a_profiled_step_is_summarized_with_its_operators():
    a = torch.randn(64, 64)
    result, prof = profiled(lambda: a @ a, "cpu")
    assert result.shape == (64, 64)
    summary = summarize(prof, wall_s=0.5, top=5)
    assert summary["wall_s"] == 0.5 and summary["gpu_compute_busy"] is None  # no device kernels on the CPU
    assert summary["link_idle_s"] is None and summary["link_idle_longest_ms"] == []  # nor copies
    assert len(summary["top_device_ops"]) <= 5
    assert any("mm" in op["name"] for op in summary["top_device_ops"])


def test_several_profiled_steps_are_summarized_per_step():
    """`--steps N` profiles N consecutive steps (the steady state): the summary's times and counts are per step, and
    it says how many steps it holds. Control: the same profile summarized as one step reads N times the time."""
    a = torch.randn(64, 64)
    _, prof = profiled(lambda: [a @ a for _ in range(4)], "cpu")
    one, four = summarize(prof, wall_s=0.8, top=5), summarize(prof, wall_s=0.8, top=5, steps=4)
    assert (one["profiled_steps"], four["profiled_steps"]) == (1, 4)
    assert one["wall_s"] == 0.8 and four["wall_s"] == 0.2
    calls = {op["name"]: op["calls"] for op in one["top_device_ops"]}
    assert {op["name"]: op["calls"] for op in four["top_device_ops"]}["aten::mm"] == calls["aten::mm"] // 4 == 1
    with pytest.raises(ValueError, match="at least 1"):
        summarize(prof, wall_s=0.8, top=5, steps=0)


def test_the_compute_waits_for_the_stream_whose_copy_ended_last_in_its_gap():
    """Kernels busy 0-10, 15-20 and 30-40: the gap 10-15 ends after a copy of stream 7 that ended at 14 (and one of
    stream 3 at 11, earlier), so it is stream 7's; in the gap 20-30 no copy ended (one ends at 31, after it): the
    host's. Control: without stream 7's copy the first gap is stream 3's."""
    kernels = [(0, 10), (15, 20), (30, 40)]
    copies = [(2, 11, 3), (12, 14, 7), (25, 31, 3)]
    assert compute_waits(kernels, copies) == {"stream 7": [1, 5.0], "host": [1, 10.0]}
    assert compute_waits(kernels, [c for c in copies if c[2] != 7]) == {"stream 3": [1, 5.0], "host": [1, 10.0]}
    assert compute_waits([(0, 10)], copies) == {}  # one busy interval: no gap


def test_the_time_two_copies_run_at_once():
    assert _overlap_us([(0, 10), (5, 20), (30, 40)]) == 5
    assert _overlap_us([(0, 10), (10, 20)]) == 0  # back to back
    assert _overlap_us([(0, 30), (5, 10), (8, 20)]) == 15  # 5-20 has two or more
