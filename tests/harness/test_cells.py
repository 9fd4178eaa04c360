"""The cells of a matrix (poros/harness/cells.py): model by model, parity first, then the reference, with ids that read like report
rows and parse as -k expressions; a poros cell always has its gate cell; a model's overrides change only that
model's settings; full-size shapes are gated off the CPU."""

from __future__ import annotations

from poros.engine.methods.method_info import REFERENCES
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


# -k expressions as a user writes them: by model, method, plan, sweep value, gate, the test's name, the suites' own
# names (which every cell carries, the collection's root folder apart), another case, `not`, and one that matches nothing
SELECTIONS = ("tiny-qwen3", "method:poros and not plan:b1", "plan:b3 or gate:parity", "grad_accum:2",
              "RESIDENT", "test_parity", "test_step and grad_accum:1", "not suites", "bench and matrix",
              "(poros or resident) and not b3", "nosuchcell")


def test_a_selection_is_known_before_the_run_as_pytest_makes_it(tmp_path, monkeypatch):
    """`preflight.selected_cells` (what `poros bench` reads before it touches OUT) selects exactly the cells pytest's
    own -k selects (`deselect_by_keyword`: its matcher over each collected item) when the suites run, for every form
    of expression; the comparison sees a keyword left out."""
    import pytest
    import yaml
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    from poros.cli.bench import SUITES
    from poros.harness import cells as cells_module
    from poros.harness.preflight import selected_cells
    from tests.suite_runs import SWEPT

    path = tmp_path / "swept.yaml"
    path.write_text(yaml.safe_dump({**SWEPT, "models": ["tiny-qwen2", "tiny-qwen3"]}))

    class Seen:  # the items the suites collect, each matched as pytest's -k matches it
        def pytest_collection_finish(self, session):
            self.by_pytest = {expr: [item.callspec.id for item in session.items
                                     if Expression.compile(expr).evaluate(KeywordMatcher.from_item(item))]
                              for expr in SELECTIONS}

    seen = Seen()
    code = pytest.main([str(SUITES / "test_matrix.py"), "-p", "poros.suites.plugin", "-c", str(SUITES / "pytest.ini"),
                        "--rootdir", str(SUITES.parent), f"--matrix={path}", f"--results={tmp_path / 'results.jsonl'}",
                        "-p", "no:cacheprovider", "--collect-only", "-q", "-s"], plugins=[seen])
    assert code == 0
    by_pytest = seen.by_pytest
    m = load_matrix(str(path))
    for expr in SELECTIONS:
        assert [c.id for c in selected_cells(m, expr)] == by_pytest[expr], expr
    assert by_pytest["nosuchcell"] == [] and len(by_pytest["not suites"]) == len(matrix_cells(m))
    assert len(by_pytest["RESIDENT"]) == 4 and len(by_pytest["bench and matrix"]) == len(matrix_cells(m))
    # negative control: without the suites' own names, `bench and matrix` would select nothing
    monkeypatch.setattr(cells_module, "SUITE_KEYWORDS", ())
    assert selected_cells(m, "bench and matrix") == [] != by_pytest["bench and matrix"]
