"""Reading an already NF4-quantized bitsandbytes checkpoint: the very bytes a bf16 build makes (plain
NF4), bnb's own dequantized weights (double quantization), and one-line refusals of other formats."""

from __future__ import annotations

import json

import pytest
import torch

from poros.store.build import build_store
from poros.errors import CheckpointError
from poros.store.arena import absmax_view, weight_view
from poros.store.layout import NF4_BLOCKSIZE
from tests.capabilities import requires_bitsandbytes
from tests.fixtures import tiny_checkpoint
from tests.store.test_build import assert_all_equal, nf4_slots

pytestmark = requires_bitsandbytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", "tiny-qwen2")


def _quantized(ckpt, folder, double: bool):
    import transformers

    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double,
                                        bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), quantization_config=q, device_map="cpu")
    model.save_pretrained(str(folder))
    return model


def test_a_transformers_nf4_checkpoint_is_the_bf16_build(ckpt, tmp_path):
    _quantized(ckpt, tmp_path / "nf4", double=False)
    expected, _ = build_store(str(ckpt), progress=False)
    got, stats = build_store(str(tmp_path / "nf4"), progress=False)
    assert stats.layers == 5 and stats.store_bytes == expected.nbytes
    assert torch.equal(got.arena, expected.arena), "NF4 bytes differ from a bf16 build's"
    assert_all_equal("NF4 slots", nf4_slots(expected), nf4_slots(got))
    assert_all_equal("dense", expected.dense, got.dense)
    assert torch.equal(got.code, expected.code)
    assert not hasattr(got.config, "quantization_config"), "the store's config is the plain model's"
    # negative control: a checkpoint of other weights is caught by the same comparison
    other, _ = build_store(str(tiny_checkpoint(tmp_path / "other", "tiny-qwen2", seed=1)), progress=False)
    assert not torch.equal(other.arena, got.arena)


def test_double_quantized_absmax_dequantizes_as_bitsandbytes_does(ckpt, tmp_path):
    import bitsandbytes.functional as F

    model = _quantized(ckpt, tmp_path / "nf4-dq", double=True)
    store, _ = build_store(str(tmp_path / "nf4-dq"), progress=False)
    modules = dict(model.named_modules())
    checked = 0
    for slot in store.slots():
        weight = modules[slot.name].weight
        assert weight.quant_state.nested, f"{slot.name} is not double-quantized"
        expected = F.dequantize_4bit(weight.data, weight.quant_state)
        state = F.QuantState(absmax=absmax_view(store.arena, slot), shape=torch.Size(slot.shape), code=store.code,
                             blocksize=NF4_BLOCKSIZE, quant_type="nf4", dtype=torch.bfloat16)
        got = F.dequantize_4bit(weight_view(store.arena, slot), state)
        assert torch.equal(expected, got), f"{slot.name}: dequantized weights differ"
        checked += 1
    assert checked == 35
    # negative control: the raw (uint8) nested absmax read as if it were the scale is wrong
    slot = next(store.slots())
    weight = modules[slot.name].weight
    raw = F.QuantState(absmax=weight.quant_state.absmax.float(), shape=torch.Size(slot.shape), code=store.code,
                       blocksize=NF4_BLOCKSIZE, quant_type="nf4", dtype=torch.bfloat16)
    assert not torch.equal(F.dequantize_4bit(weight.data, weight.quant_state),
                           F.dequantize_4bit(weight_view(store.arena, slot), raw))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,named",
    [({"bnb_4bit_quant_type": "fp4"}, "'fp4', expected 'nf4'"),
     ({"load_in_4bit": False, "load_in_8bit": True, "_load_in_8bit": True}, "8-bit")],
    ids=["quant=fp4", "quant=int8"],
)
def test_other_bitsandbytes_formats_are_refused(ckpt, tmp_path, changes, named):
    _quantized(ckpt, tmp_path / "q", double=False)
    _edit_config(tmp_path / "q", **changes)
    with pytest.raises(CheckpointError) as e:
        build_store(str(tmp_path / "q"), progress=False)
    line = str(e.value)
    assert "\n" not in line and named in line and str(tmp_path / "q") in line


def test_another_blocksize_is_refused(ckpt, tmp_path):
    import bitsandbytes.functional as F
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "q"
    _quantized(ckpt, folder, double=False)
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.2.mlp.up_proj.weight"
    w = load_file(str(ckpt / "model.safetensors"))[name]
    packed, state = F.quantize_4bit(w, blocksize=128, compress_statistics=False, quant_type="nf4")
    tensors[name] = packed
    tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        build_store(str(folder), progress=False)
    assert "\n" not in str(e.value) and name in str(e.value) and "blocksize 128" in str(e.value)


def test_a_missing_quant_state_is_named(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "q"
    _quantized(ckpt, folder, double=False)
    shard = next(folder.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(str(shard)).items() if k != "model.layers.0.self_attn.o_proj.weight.absmax"}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        build_store(str(folder), progress=False)
    assert "model.layers.0.self_attn.o_proj.weight.absmax" in str(e.value)
