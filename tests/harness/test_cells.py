"""The cells of a matrix (poros/harness/cells.py): model by model, parity first, then the reference, with ids that read like report
rows and parse as -k expressions; a poros cell always has its gate cell; a model's overrides change only that
model's settings; full-size shapes are gated off the CPU."""

from __future__ import annotations

from poros.engine.method_info import REFERENCES
from poros.harness.cells import matrix_cells, model_unavailable
from poros.harness.matrix import load_matrix, parse_matrix
from tests.suite_runs import TINY


def test_cells_run_model_by_model_parity_first():
    m = load_matrix("cpu")
    cells = matrix_cells(m)
    assert len(cells) == len(m.models) * (1 + len(m.methods))
    for i, model in enumerate(m.models):
        chunk = cells[i * (1 + len(m.methods)) : (i + 1) * (1 + len(m.methods))]
        assert [c.model for c in chunk] == [model] * len(chunk)
        references = [x for x in m.methods if x.value in REFERENCES]  # a reference first: streamed rows' floor
        assert references and chunk[0].method is None
        assert [c.method for c in chunk[1:]] == references + [x for x in m.methods if x not in references]


def test_cell_ids_read_like_report_rows():
    m = load_matrix("cpu")
    ids = [c.id for c in matrix_cells(m)]
    assert "model:tiny-qwen3-stack:current-gate:parity" in ids
    assert "model:tiny-qwen3-stack:current-method:poros" in ids
    from _pytest.mark.expression import Expression

    for expr in ("method:resident", "model:tiny-qwen3 and method:poros", "stack:current and gate:parity"):
        Expression.compile(expr)  # the -k forms the ids are made for parse (`method=resident` did not)


def test_real_shapes_are_gated_off_the_cpu():
    assert "GPU" in model_unavailable("qwen2.5-72b", "cpu")
    assert model_unavailable("qwen2.5-72b", "cuda") is None
    assert model_unavailable("tiny-qwen2", "cpu") is None


def test_a_poros_cell_is_never_timed_without_its_gate():
    """A matrix of poros alone still has its gate cell (resident QLoRA run for the reference, not timed); a
    matrix of no gated method has none."""
    poros = matrix_cells(parse_matrix({**TINY, "methods": ["poros"], "models": ["tiny-qwen2"]}))
    assert [c.id for c in poros] == ["model:tiny-qwen2-stack:current-gate:parity",
                                     "model:tiny-qwen2-stack:current-method:poros"]
    alone = matrix_cells(parse_matrix({**TINY, "methods": ["resident"], "models": ["tiny-qwen2"]}))
    assert [c.id for c in alone] == ["model:tiny-qwen2-stack:current-method:resident"]


def test_model_overrides_change_only_that_models_schedule():
    from poros.harness.cells import train_config

    m = parse_matrix({**TINY, "methods": ["poros", "resident"], "models": ["tiny-qwen2", "tiny-qwen3"],
                      "overlap_backward": True, "model_overrides": {"tiny-qwen3": {"overlap_backward": False,
                                                                                   "vram_budget": "300MB"}}})
    q2, q3 = train_config(m, "tiny-qwen2"), train_config(m, "tiny-qwen3")
    assert q2.overlap_backward and q2.vram_budget is None
    assert not q3.overlap_backward and q3.vram_budget == 300 * 10**6
    assert q2.replace(model="tiny-qwen3", overlap_backward=False, vram_budget=300 * 10**6) == q3  # nothing else


def test_each_cells_console_label_tells_it_from_every_other():
    """Two poros plans of one model, or one method at two sweep points, read apart on the console."""
    m = parse_matrix({**{k: v for k, v in TINY.items() if k != "seq_len"}, "models": ["tiny-qwen2"],
                      "methods": ["poros", "resident"],
                      "sweep": {"seq_len": [64, 128]}, "plans": {"streamed": {}, "kept": {"keep_activations": True}}})
    labels = [c.label for c in matrix_cells(m)]
    assert len(set(labels)) == len(labels), labels
    assert labels[:4] == ["tiny-qwen2 seq_len=64 parity gate", "tiny-qwen2 seq_len=64 resident",
                          "tiny-qwen2 seq_len=64 poros plan streamed", "tiny-qwen2 seq_len=64 poros plan kept"], labels
    plain = [c.label for c in matrix_cells(load_matrix("cpu"))]
    assert plain[:3] == ["tiny-qwen2 parity gate", "tiny-qwen2 resident", "tiny-qwen2 poros"], plain


def test_labels_without_the_plan_would_repeat():
    """Negative control: the model and method alone name two plans' cells alike."""
    m = parse_matrix({**TINY, "models": ["tiny-qwen2"], "methods": ["poros"],
                      "plans": {"streamed": {}, "kept": {"keep_activations": True}}})
    bare = [f"{c.model} {c.method.value}" for c in matrix_cells(m) if c.method]
    assert len(set(bare)) < len(bare)
