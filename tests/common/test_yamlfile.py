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
