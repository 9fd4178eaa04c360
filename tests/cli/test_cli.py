"""The `poros` command line: env block, model list, and a CPU build report."""

from __future__ import annotations

import json

import pytest

from poros.cli import main
from poros.models.shapes import SHAPES
from tests.capabilities import requires_bitsandbytes


def test_env_lists_the_stack(capsys):
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for pkg in ("torch", "transformers", "peft", "bitsandbytes", "poros"):
        hits = [l for l in lines if l.lstrip("- ").startswith(f"{pkg}:")]
        assert len(hits) == 1, f"expected one line for {pkg}, got {hits} in {lines}"
        assert hits[0].split(":", 1)[1].strip(), f"{pkg}: no version"


def test_env_json_is_parseable(capsys):
    assert main(["env", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["torch"]


def test_build_list_names_every_shape(capsys):
    assert main(["build", "--list"]) == 0
    rows = [l.split() for l in capsys.readouterr().out.splitlines() if l.strip()]
    assert [r[0] for r in rows] == list(SHAPES)
    for row in rows:
        assert row[1] == SHAPES[row[0]].arch


@requires_bitsandbytes
def test_build_tiny_prints_json(capsys):
    assert main(["build", "--model", "tiny-qwen2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    record = json.loads(out[0])
    assert record["model"] == "tiny-qwen2" and record["layers"] == 5 and record["device"] == "cpu"
    assert record["peak_device_gb"] is None


def test_build_without_model_is_exit_2(capsys):
    assert main(["build"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0]


def test_unknown_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    assert "frobnicate" in capsys.readouterr().err


def test_version(capsys):
    import pytest

    from poros.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("poros ")


@pytest.mark.parametrize("command", ["train", "plan"])
def test_help_shows_one_default_per_flag(capsys, command):
    """Every option that takes a value and may be left out says its default once; none says two."""
    import re

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    options = re.split(r"\n  (?=-)", text.split("\noptions:\n", 1)[1].split("\n\n")[0])
    checked = 0
    for opt in options:
        flag = opt.split()[0].rstrip(",")
        words = " ".join(opt.split())
        shown = words.count("(default: ")
        assert shown <= 1, f"{flag}: {shown} defaults in {words!r}"
        takes_value = len(opt.split("  ")[0].split()) > 1 and not flag.startswith("-h")
        if takes_value and flag not in ("--model", "--data", "--out", "-o", "--steps"):
            assert shown == 1, f"{flag}: no default in {words!r}"
            checked += 1
    assert checked >= 15, options
    if command == "plan":
        assert "(default: cuda: its costs, no device needed)" in " ".join(text.split())  # as the plan is made


@pytest.mark.parametrize("argv", [["train"], ["export", "--merge", "--model", "m", "--adapter", "a"],
                                  ["bench", "matrix", "cpu"]], ids=["train", "export", "bench"])
def test_dash_o_is_out_wherever_out_is(argv):
    from poros.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([*argv, "-o", "there"]).out == parser.parse_args([*argv, "--out", "there"]).out == "there"


def _epilogs():
    """Every (sub)command's epilog as --help shows it, by command."""
    from poros.cli import build_parser

    found, todo = {}, [("poros", build_parser())]
    while todo:
        name, parser = todo.pop()
        found[name] = parser.epilog or ""
        for action in parser._actions:
            if isinstance(action, __import__("argparse")._SubParsersAction):
                todo += [(f"{name} {n}", p) for n, p in action.choices.items()]
    return found


def continued_lines(text: str) -> list[str]:
    """Lines of an example where a continued source line left a run of spaces before an option."""
    import re

    return [line for line in text.splitlines() if re.search(r"\S {3,}--?\w", line)]


def test_no_help_example_shows_a_continued_line_as_spaces():
    epilogs = _epilogs()
    assert len(epilogs) > len(("poros", "bench matrix")), sorted(epilogs)
    assert {name: continued_lines(text) for name, text in epilogs.items() if continued_lines(text)} == {}


def test_a_continued_line_is_found():
    """Negative control: the example as a backslash-newline inside a plain string leaves it."""
    text = "  poros bench matrix cpu --benchmark-compare x.json \
      --benchmark-compare-fail mean:25%   # exit 1"
    assert continued_lines(text) == [text]
    assert continued_lines("  poros bench matrix cpu -o out/h200 --resume      # continue a killed run") == []


def product_value(line: str) -> tuple[int, int]:
    """(what `A × B × (C + D)` before `=` works out to, the count after it) of a `poros validate` line."""
    import re

    product, count = line.split(": ", 1)[1].split(" = ")
    arithmetic = re.sub(r"[a-z]+", "", product).replace("×", "*")
    return eval(arithmetic, {"__builtins__": {}}), int(count.split()[0])


def test_validate_prints_a_product_that_multiplies_out(capsys):
    from poros.cli.validate import cell_product
    from poros.harness.cells import matrix_cells
    from poros.harness.matrix import MATRICES, load_matrix

    for path in sorted(MATRICES.glob("*.yaml")):  # every shipped matrix's product, as validate words it
        m = load_matrix(path)
        line = f"ok   {path}: {cell_product(m)} = {sum(c.method is not None for c in matrix_cells(m))} timed cells"
        got, count = product_value(line)
        assert got == count, line
    assert main(["validate", "h200-copy-floor"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.endswith(": 1 model × (1 method + 4 poros plans) = 5 timed cells"), line


def test_a_product_that_does_not_multiply_out_is_found():
    """Negative control: the form that listed poros's plans as one more factor."""
    line = "ok   m.yaml: 5 models × 1 stacks × 3 methods × 2 sweep points × 8 poros plans = 100 timed cells"
    assert product_value(line) == (240, 100)
    assert product_value("ok   m.yaml: 1 model × (2 methods + 10 poros plans) = 12 timed cells") == (12, 12)
