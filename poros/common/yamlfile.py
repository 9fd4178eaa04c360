"""YAML as Poros reads it (matrix files, `poros train --config` files and their `key=value` overrides)."""

from __future__ import annotations

import re

import yaml


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader reading numbers as YAML 1.2 does (`1e-4` and `2e9` are numbers: YAML 1.1, which
    PyYAML follows, needs a dot and a signed exponent, so it reads them as strings), and refusing a key given
    twice in one mapping."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _mapping_once(loader: YamlLoader, node, deep: bool = False) -> dict:
    """A mapping whose keys are each given once: PyYAML keeps the last of a repeated key without a word, so a
    setting given twice (`lr:` on two lines) would be decided by its order."""
    first: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: construct_mapping merges it
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            again = key in first
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if again:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given on line {first[key]} and again on line {line}; give it once",
                key_node.start_mark)
        first[key] = line
    return loader.construct_mapping(node, deep=deep)


YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_once)


# The most values a document may expand to through its aliases (`*name`): a matrix or a run's config holds a few
# hundred; a chain of aliases each repeating the one before ("billion laughs") grows exponentially with its lines.
MAX_VALUES = 100_000


def _expanded(node, sizes: dict, open_: set) -> int:
    """How many values `node` stands for once every alias in it is expanded (`sizes` memoizes by node: an alias
    is the node it names)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it (a value holding "
                                          "itself); write the value out", node.start_mark)
    open_.add(key)
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded(x, sizes, open_) for x in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded(k, sizes, open_) + _expanded(v, sizes, open_) for k, v in node.value)
    else:
        size = 1
    open_.discard(key)
    sizes[key] = size
    if size > MAX_VALUES:
        raise yaml.composer.ComposerError(None, None, f"its aliases (*name) expand it to more than {MAX_VALUES:,} "
                                          f"values; a matrix or config holds a few hundred", node.start_mark)
    return size


def load_yaml(text: str):
    """Parse YAML text with `YamlLoader`; a document whose aliases would expand it past `MAX_VALUES` values (or
    into a value that holds itself) is refused before anything is built from it, as is one nested deeper than
    Python's recursion reaches.

    Raises:
        yaml.YAMLError: the text is not valid YAML (callers name their file in the message).
    """
    loader = YamlLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded(node, {}, set())
        return loader.construct_document(node)
    except RecursionError:  # PyYAML composes and constructs nested values recursively
        raise yaml.YAMLError("its values are nested too deeply (thousands of levels of [ or {); a matrix or config "
                             "nests a few") from None
    finally:
        loader.dispose()
