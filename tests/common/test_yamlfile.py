"""YAML as Poros reads it: numbers as YAML 1.2 reads them."""

from __future__ import annotations

import pytest
import yaml

from poros.common.yamlfile import load_yaml


def test_exponents_without_a_dot_or_a_sign_are_numbers():
    text = "lr: 1e-4\nbudget: 2e9\nname: 1e-4x\nsteps: 10\n"
    assert load_yaml(text) == {"lr": 1e-4, "budget": 2e9, "name": "1e-4x", "steps": 10}
    assert yaml.safe_load(text)["lr"] == "1e-4"  # negative control: PyYAML's own reading, a string


def test_invalid_yaml_raises_yamls_error():
    with pytest.raises(yaml.YAMLError):
        load_yaml("a: [1, 2\n")


def _laughs(levels: int) -> str:
    """A chain of aliases, each line nine of the one before: 9**levels values from a few hundred bytes."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines + [f"models: *a{levels - 1}"]) + "\n"


def test_aliases_that_expand_past_the_bound_are_refused_before_anything_is_built():
    import time

    t0 = time.perf_counter()
    with pytest.raises(yaml.YAMLError, match="expand it to more than 100,000 values"):
        load_yaml(_laughs(9))  # 387 million values
    assert time.perf_counter() - t0 < 5, "refused from the node graph, not after building the values"
    # negative control: aliases within the bound load as before (a merge key among them)
    assert len(load_yaml(_laughs(4))["models"]) == 9
    assert load_yaml("d: &x {e: 1}\nf:\n  <<: *x\n  g: 2\n") == {"d": {"e": 1}, "f": {"e": 1, "g": 2}}


def test_a_value_that_holds_itself_through_an_alias_is_refused():
    with pytest.raises(yaml.YAMLError, match="refers to a node that contains it"):
        load_yaml("a: &a [1, *a]\n")
    assert load_yaml("a: &a [1]\nb: *a\n") == {"a": [1], "b": [1]}  # control: an alias to another node


def test_poros_validate_refuses_an_alias_bomb_in_one_line(tmp_path):
    from poros.cli import main

    path = tmp_path / "bomb.yaml"
    path.write_text(_laughs(9))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["validate", str(path)]) == 1
    text = out.getvalue()
    assert "expand it to more than 100,000 values" in text and len(text) < 500, text[:500]


@pytest.mark.parametrize("text", ["a: " + "[" * 100_000 + "]" * 100_000 + "\n",
                                  "a: " + "{b: " * 50_000 + "1" + "}" * 50_000 + "\n"], ids=["lists", "mappings"])
def test_values_nested_deeper_than_recursion_reaches_are_one_yaml_error(text):
    with pytest.raises(yaml.YAMLError, match="nested too deeply"):
        load_yaml(text)
    assert load_yaml("a: [[[1]]]\n") == {"a": [[[1]]]}  # control: a few levels load
