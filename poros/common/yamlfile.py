"""YAML as Poros reads it (matrix files, `poros train --config` files and their `key=value` overrides)."""

from __future__ import annotations

import re

import yaml


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does: `1e-4` and `2e9` are numbers (YAML 1.1, which
    PyYAML follows, needs a dot and a signed exponent, so it reads them as strings)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def load_yaml(text: str):
    """Parse YAML text with `YamlLoader`.

    Raises:
        yaml.YAMLError: the text is not valid YAML (callers name their file in the message).
    """
    return yaml.load(text, Loader=YamlLoader)
