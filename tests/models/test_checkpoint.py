"""Checkpoint folders that cannot be built end in one line naming the file and tensor at fault, not
a traceback: corrupt or truncated safetensors, mis-shaped, non-float or non-finite tensors, a broken
index, architectures that are no causal LM, and layer types Poros cannot quantize (GPT-2's Conv1D)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from poros.store.build import build_store
from poros.errors import CheckpointError
from poros.models.shapes import get_shape
from tests.capabilities import requires_bitsandbytes

pytestmark = requires_bitsandbytes


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg and "Traceback" not in msg, f"not a one-line message: {msg!r}"
    return msg


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny-qwen2 checkpoint saved by transformers (config.json + model.safetensors)."""
    import transformers

    path = tmp_path_factory.mktemp("ckpt") / "tiny-qwen2"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(get_shape("tiny-qwen2").config(), dtype=torch.bfloat16
                                                  ).save_pretrained(str(path))
    return path


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A private copy of the saved checkpoint, for one test to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _edit(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _refused(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        build_store(str(path), progress=False)
    return _one_line(e.value)


def test_the_undamaged_checkpoint_builds(ckpt):
    """Control: the copy every other test damages builds as it is."""
    store, stats = build_store(str(ckpt), progress=False)
    assert stats.layers == get_shape("tiny-qwen2").config().num_hidden_layers


def test_a_corrupt_file_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 7 + b"not safetensors at all" * 10)
    msg = _refused(ckpt)
    assert f"{ckpt / 'model.safetensors'}: not a readable safetensors file" in msg, msg


@pytest.mark.parametrize("where", ["header", "data"])
def test_a_truncated_file_is_named(ckpt, where):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    header = 8 + struct.unpack("<Q", raw[:8])[0]
    f.write_bytes(raw[: header // 2] if where == "header" else raw[: header + (len(raw) - header) // 2])
    msg = _refused(ckpt)
    assert str(f) in msg and "truncated or corrupt" in msg, msg


@pytest.mark.parametrize("shape", [(1,), (64, 1)], ids=["broadcastable", "mismatched"])
def test_a_wrongly_shaped_tensor_is_named_with_both_shapes(ckpt, shape):
    """A [1] norm weight would broadcast over the [64] one without a word: refused like any other."""
    name = "model.layers.1.input_layernorm.weight" if len(shape) == 1 else "model.layers.1.mlp.down_proj.weight"

    def change(t):
        expected = list(t[name].shape)
        t[name] = torch.ones(shape, dtype=t[name].dtype)
        change.expected = expected

    _edit(ckpt, change)
    msg = _refused(ckpt)
    assert f"tensor {name} has shape {list(shape)}, expected {change.expected}" in msg, msg
    assert str(ckpt / "model.safetensors") in msg


def test_an_integer_tensor_where_weights_belong_is_named(ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"
    _edit(ckpt, lambda t: t.__setitem__(name, torch.zeros(t[name].shape, dtype=torch.int8)))
    msg = _refused(ckpt)
    assert f"tensor {name} is torch.int8" in msg, msg


def test_non_finite_weights_are_named(ckpt):
    name = "model.layers.2.mlp.up_proj.weight"

    def change(t):
        t[name] = t[name].clone()
        t[name][0, :3] = float("nan")

    _edit(ckpt, change)
    msg = _refused(ckpt)
    assert f"tensor {name} holds 3 NaN/inf values" in msg, msg


def test_a_broken_index_is_named(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    msg = _refused(ckpt)
    assert "model.safetensors.index.json: not a safetensors index" in msg, msg


def test_a_config_of_no_causal_lm_is_named(ckpt):
    import transformers

    # as many layers as the qwen2 weights left in the folder hold, so the architecture is what is refused
    transformers.ViTConfig(hidden_size=64, num_hidden_layers=5, num_attention_heads=4).save_pretrained(str(ckpt))
    msg = _refused(ckpt)
    assert "model_type 'vit'" in msg and "no causal-LM model" in msg, msg


def test_a_causal_lm_without_a_decoder_layer_list_is_named(ckpt):
    import transformers

    transformers.BertConfig(hidden_size=64, num_hidden_layers=5, num_attention_heads=4, intermediate_size=128,
                            vocab_size=256, is_decoder=True).save_pretrained(str(ckpt))
    msg = _refused(ckpt)
    assert msg.startswith(f"{ckpt}: BertLMHeadModel: no decoder layer list"), msg


def test_gpt2_conv1d_layers_are_refused_naming_the_module(tmp_path):
    import transformers

    path = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    msg = _refused(path)
    assert "transformer.h.0.attn.c_attn.weight belongs to a Conv1D" in msg and "cannot quantize" in msg, msg
    from poros.harness import preflight

    problems = preflight.model_problems([str(path)], 64)  # `poros validate` and bench say so before any build
    assert len(problems) == 1 and "Conv1D" in problems[0]
    assert json.loads((path / "config.json").read_text())["model_type"] == "gpt2"


def _config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes,named", [
    ({"num_hidden_layers": 0, "layer_types": []}, "num_hidden_layers is 0; a model to fine-tune has at least one"),
    ({"num_hidden_layers": 3}, "`num_hidden_layers` (3) must be equal to the number of `layer_types` (5)"),
    ({"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4},
     "num_hidden_layers is 4, but the weights hold decoder layer 4 (5 layers)"),
    ({"vocab_size": -5}, "vocab_size is -5, expected an integer > 0"),
    ({"num_attention_heads": 0}, "num_attention_heads is 0, expected an integer > 0"),
], ids=["zero-layers", "layer-types-disagree", "weights-of-more-layers", "vocab-negative", "heads-zero"])
def test_configs_that_do_not_describe_the_weights_are_named_from_the_config(ckpt, changes, named):
    """Knowable before any build: transformers' own validation, no layer at all, and weights of layers the config
    leaves out (they would be dropped without a word). Control: the undamaged checkpoint resolves (first test)."""
    from poros.models.checkpoint import resolve

    _config(ckpt, **changes)
    with pytest.raises(CheckpointError) as e:
        resolve(str(ckpt))
    msg = _one_line(e.value)
    assert msg.startswith(f"{ckpt}/config.json: ") and named in msg, msg


def test_a_config_alone_is_still_a_shape_to_plan(ckpt):
    """`poros plan` takes a folder of config.json alone: the layer count is checked only against weights."""
    from poros.models.checkpoint import resolve

    (ckpt / "model.safetensors").unlink()
    _config(ckpt, num_hidden_layers=4, layer_types=["full_attention"] * 4)
    assert resolve(str(ckpt)).config.num_hidden_layers == 4
