"""A cell's results row (poros/harness/result_row.py), what `copy_summary` makes of its steps' counters: a copy
rate over only the bytes its time covers, the attention calls recomputes took from the forward, and the CUDA graph
templates' capture errors."""

from __future__ import annotations

import pytest


def test_copy_rate_counts_only_the_bytes_its_time_covers():
    """With saved inputs in host memory, their bytes come back on the copy stream outside the timed
    weight copies: counting them in read 63.6 GB/s on a 55 GB/s link."""
    from poros.harness.result_row import copy_summary

    step = {"bytes_h2d": 110, "input_bytes_h2d": 55, "copy_s": 1e-9, "copy_wait_s": 0.0}
    out = copy_summary([step, step])
    assert out["bytes_h2d_per_step"] == 110 and out["weight_bytes_h2d_per_step"] == 55
    assert out["copy_gbps"] == pytest.approx(55.0)


def test_rows_count_the_attention_calls_recomputes_took_from_the_forward():
    from poros.harness.result_row import copy_summary

    base = {"bytes_h2d": 10, "copy_s": 1.0, "copy_wait_s": 0.0}
    assert "attention_replayed_per_step" not in copy_summary([base])
    out = copy_summary([{**base, "attention_replayed": 80, "attention_computed": 0},
                        {**base, "attention_replayed": 78, "attention_computed": 2}])
    assert out["attention_replayed_per_step"] == 79 and out["attention_computed_per_step"] == 1


def test_rows_carry_the_cuda_graph_templates_capture_errors():
    from poros.harness.result_row import copy_summary

    base = {"bytes_h2d": 10, "copy_s": 1.0, "copy_wait_s": 0.0}
    assert "capture_errors" not in copy_summary([base])
    first = {**base, "graphs_captured": 3, "capture_errors": 1, "template_fallbacks": 2, "layer_templates": 4}
    last = {**first, "template_fallbacks": 5}  # counted from the trainer's start: the last step's holds all
    out = copy_summary([first, last])
    assert (out["graphs_captured"], out["capture_errors"], out["template_fallbacks"]) == (3, 1, 5)
