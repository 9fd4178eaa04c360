"""Model shapes: real shapes match their published size, tiny shapes stay tiny and on the same code path."""

from __future__ import annotations

import pytest

from poros.errors import UnknownModelError
from poros.models.shapes import SHAPES, count_params, get_shape

REAL = [name for name, s in SHAPES.items() if not s.tiny]
TINY_SIBLINGS = {
    "tiny-qwen2": ["qwen2.5-32b", "qwen2.5-72b"],
    "tiny-qwen3": ["qwen3-32b"],
    "tiny-gemma3": ["gemma3-27b"],
    "tiny-gemma4": ["gemma4-31b"],
}


def test_registry_has_real_and_tiny_shapes():
    assert REAL, "no real (non-tiny) shapes registered"
    assert sorted(n for n, s in SHAPES.items() if s.tiny) == sorted(TINY_SIBLINGS)


@pytest.mark.parametrize("name", REAL, ids=[f"model={n}" for n in REAL])
def test_param_count_matches_published(name):
    shape = get_shape(name)
    assert shape.published_params is not None, f"{name}: real shape without published_params"
    got = count_params(shape.config())
    rel = got / shape.published_params - 1
    assert abs(rel) < 0.01, (
        f"{name}: {got / 1e9:.3f}B params from the config vs {shape.published_params / 1e9:.3f}B published "
        f"({rel:+.2%}, limit ±1%)"
    )


@pytest.mark.parametrize("tiny", list(TINY_SIBLINGS), ids=[f"model={n}" for n in TINY_SIBLINGS])
def test_tiny_shape_is_small_and_same_family(tiny):
    shape = get_shape(tiny)
    assert shape.tiny and shape.published_params is None
    n = count_params(shape.config())
    assert n < 5_000_000, f"{tiny}: {n} params, expected < 5M"
    model_type = shape.config().model_type
    for big in TINY_SIBLINGS[tiny]:
        assert get_shape(big).config().model_type == model_type, f"{tiny} ({model_type}) vs {big}"
        assert get_shape(big).arch == shape.arch


def test_config_is_fresh_each_call():
    a = get_shape("tiny-qwen2").config()
    a.num_hidden_layers = 99
    assert get_shape("tiny-qwen2").config().num_hidden_layers != 99


def test_unknown_model_lists_known_names():
    with pytest.raises(UnknownModelError) as e:
        get_shape("nope")
    msg = str(e.value)
    assert "'nope'" in msg and "\n" not in msg
    missing = [n for n in SHAPES if n not in msg]
    assert not missing, f"message does not list {missing}: {msg}"


@pytest.mark.parametrize("name", ["gemma3-27b", "qwen2.5-72b"])
def test_a_cut_keeps_the_first_layers_each_of_its_attention_kind(name):
    full = get_shape(name).config()
    cut = get_shape(name).cut(6)
    assert cut.num_hidden_layers == 6 and cut.layer_types == full.layer_types[:6]
    assert (cut.hidden_size, cut.intermediate_size, cut.vocab_size) == (full.hidden_size, full.intermediate_size,
                                                                        full.vocab_size)
    assert count_params(cut) < count_params(full) / 5


@pytest.mark.parametrize("layers", [0, 6])
def test_a_cut_outside_the_shapes_layers_is_refused(layers):
    with pytest.raises(ValueError, match="tiny-qwen2 has 5 decoder layers"):
        get_shape("tiny-qwen2").cut(layers)


def test_a_cut_source_names_its_layers():
    from poros.models.checkpoint import cut_source

    source = cut_source("tiny-gemma3", 3)
    assert source.name == "tiny-gemma3-3l" and source.config.num_hidden_layers == 3 and source.checkpoint is None
    with pytest.raises(UnknownModelError):
        cut_source("nope", 3)
