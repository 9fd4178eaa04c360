"""Double quantization in the store: each slot holds what bitsandbytes' `quantize_4bit(...,
compress_statistics=True)` makes, dequantizes as bitsandbytes' own double-quantized Linear4bit does, reads
from and writes to double-quantized checkpoints, and is smaller by what the layout says."""

from __future__ import annotations

import pytest
import torch

from poros.models.checkpoint import resolve
from poros.models.shapes import SHAPES
from poros.store.arena import slot_tensors
from poros.store.layout import NESTED_BLOCKSIZE, NF4_BLOCKSIZE, plan_layout, slot_nbytes
from poros.store.build import build_store
from poros.store.host_memory import config_host_need, store_bytes
from poros.store.quantize import quant_state
from tests.capabilities import requires_bitsandbytes
from tests.fixtures import tiny_checkpoint
from tests.store.test_build import assert_all_equal

REAL = [name for name, s in SHAPES.items() if not s.tiny]


def slot_state(store) -> dict[str, torch.Tensor]:
    """Every tensor of every slot, by name (uint8 absmax, nested absmax and offset where double-quantized)."""
    out = {}
    for slot in store.slots():
        for part, t in slot_tensors(store.arena, slot)._asdict().items():
            if t is not None:
                out[f"{slot.name}.{part}"] = t.clone()
    return out


def dequantized(store, slot, tensors=None) -> torch.Tensor:
    import bitsandbytes.functional as F

    t = tensors or slot_tensors(store.arena, slot)
    return F.dequantize_4bit(t.weight, quant_state(t, store.code, store.nested_code, slot.shape))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", "tiny-qwen2")


def _bnb_model(ckpt, double: bool):
    """bitsandbytes' own NF4 model of `ckpt` through transformers (what users load), on the CPU."""
    import transformers

    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double,
                                        bnb_4bit_compute_dtype=torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), quantization_config=q, device_map="cpu")


# --- the layout ----------------------------------------------------------------------------------


def test_slot_bytes_of_double_quantization():
    """A 4096 x 4096 matrix: 8 MiB of packed weight either way; 262,144 absmax as float32 (1 MiB) or uint8
    (256 KiB), then 1,024 nested float32 absmax and the offset."""
    n = 4096 * 4096
    assert slot_nbytes(n, False) == (n // 2, 4 * n // NF4_BLOCKSIZE, 0)
    assert slot_nbytes(n, True) == (n // 2, n // NF4_BLOCKSIZE, 4 * (n // NF4_BLOCKSIZE // NESTED_BLOCKSIZE + 1))
    (plain,), end_plain = plan_layout([[("w", (4096, 4096))]])
    (dq,), end_dq = plan_layout([[("w", (4096, 4096))]], double_quant=True)
    assert end_plain == n // 2 + n // 16 and end_dq == n // 2 + n // 64 + 4352  # 1,025 floats rounded up to 256
    slot = dq.slots[0]
    assert slot.double_quant and not plain.slots[0].double_quant
    assert slot.absmax_offset == n // 2 and slot.nested_offset == n // 2 + n // 64 and slot.nested_numel == 1024


@pytest.mark.parametrize("model", REAL, ids=[f"model={m}" for m in REAL])
def test_the_nf4_arena_shrinks_by_a_twelfth(model):
    """From the shapes alone: the decoder layers' NF4 bytes (0.5625 -> 0.5159 bytes a weight, padding aside);
    the dense weights (embeddings, lm_head, norms) are bf16 either way."""
    config = resolve(model).config
    plain, dq = config_host_need(config, "meta"), config_host_need(config, "meta", double_quant=True)
    assert dq.dense == plain.dense
    assert 0.082 < 1 - dq.arena / plain.arena < 0.083, f"{model}: arena {plain.arena} -> {dq.arena} bytes"
    assert store_bytes(config, double_quant=True) == dq.store < store_bytes(config)


# --- the bytes are bitsandbytes' -----------------------------------------------------------------


@requires_bitsandbytes
def test_a_double_quantized_build_holds_what_bitsandbytes_makes(ckpt):
    """Every slot of a double-quantized build of a bf16 checkpoint: the packed weight, the uint8 absmax, the
    nested absmax and the offset of bitsandbytes' quantize_4bit(compress_statistics=True) of the same weight,
    and its packed weight the plain build's."""
    import bitsandbytes.functional as F
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    store, _ = build_store(str(ckpt), progress=False, double_quant=True)
    plain, _ = build_store(str(ckpt), progress=False)
    assert store.double_quant and not plain.double_quant
    expected = {}
    for slot in store.slots():
        packed, state = F.quantize_4bit(weights[f"{slot.name}.weight"].to(torch.bfloat16), blocksize=64,
                                        compress_statistics=True, quant_type="nf4")
        expected.update({f"{slot.name}.weight": packed, f"{slot.name}.absmax": state.absmax,
                         f"{slot.name}.nested_absmax": state.state2.absmax, f"{slot.name}.offset": state.offset})
        assert torch.equal(state.state2.code, store.nested_code) and torch.equal(state.code, store.code)
    assert_all_equal("double-quantized slots vs bitsandbytes", expected, slot_state(store))
    packed = {k: v for k, v in slot_state(plain).items() if k.endswith(".weight")}
    assert_all_equal("packed weights, plain vs double-quantized", packed,
                     {k: v for k, v in slot_state(store).items() if k.endswith(".weight")})
    # the absmax differs once expanded: the setting changes the weights (and so every bit of a run)
    assert not torch.equal(dequantized(store, next(store.slots())), dequantized(plain, next(plain.slots())))


@requires_bitsandbytes
def test_dequantized_weights_are_bitsandbytes_own_double_quantized_linear4bit(ckpt, tmp_path):
    """transformers + bitsandbytes load the bf16 checkpoint double-quantized; the store read from its saved
    folder with double_quant holds its very bytes (and those of a double-quantized bf16 build), and each
    of poros's Linear4bit modules dequantizes to the bnb model's weights."""
    import bitsandbytes.functional as F

    from poros.config import TrainConfig
    from poros.engine.model.qlora import QLoRAModel

    bnb = _bnb_model(ckpt, double=True)
    bnb.save_pretrained(str(tmp_path / "nf4-dq"))
    store, _ = build_store(str(tmp_path / "nf4-dq"), progress=False, double_quant=True)
    built, _ = build_store(str(ckpt), progress=False, double_quant=True)
    assert torch.equal(store.arena, built.arena), "a double-quantized checkpoint is not the double-quantized build"
    model = QLoRAModel(store, TrainConfig(model="tiny-qwen2", double_quant=True), torch.device("cpu"))
    model.materialize_resident()
    modules = dict(bnb.named_modules())
    for slot in store.slots():
        theirs = modules[slot.name].weight
        ours = model.linear4bit[slot.name].weight
        assert theirs.quant_state.nested and ours.quant_state.nested, slot.name
        expected = F.dequantize_4bit(theirs.data, theirs.quant_state)
        assert torch.equal(expected, F.dequantize_4bit(ours.data, ours.quant_state)), slot.name
        assert torch.equal(ours.quant_state.offset, theirs.quant_state.offset), slot.name
    # negative controls: the nested absmax without its offset, or with the offset 1% off, is other weights
    slot = next(store.slots())
    t = slot_tensors(store.arena, slot)
    theirs = modules[slot.name].weight
    expected = F.dequantize_4bit(theirs.data, theirs.quant_state)
    for wrong in (torch.zeros_like(t.offset), t.offset * 1.01):
        assert not torch.equal(expected, dequantized(store, slot, t._replace(offset=wrong)))


@requires_bitsandbytes
def test_checkpoints_of_either_form_read_into_either_store(ckpt, tmp_path):
    """A double-quantized checkpoint read without double_quant: its absmax expanded to float32 (it dequantizes
    to the same weights); a plain checkpoint read with double_quant: the bytes of a double-quantized build."""
    _bnb_model(ckpt, double=True).save_pretrained(str(tmp_path / "dq"))
    _bnb_model(ckpt, double=False).save_pretrained(str(tmp_path / "plain"))
    expanded, _ = build_store(str(tmp_path / "dq"), progress=False)
    nested, _ = build_store(str(tmp_path / "dq"), progress=False, double_quant=True)
    assert not expanded.double_quant and nested.double_quant
    assert expanded.nbytes > nested.nbytes
    for slot_e, slot_n in zip(expanded.slots(), nested.slots()):
        assert torch.equal(dequantized(expanded, slot_e), dequantized(nested, slot_n)), slot_e.name
    renested, _ = build_store(str(tmp_path / "plain"), progress=False, double_quant=True)
    built, _ = build_store(str(ckpt), progress=False, double_quant=True)
    assert torch.equal(renested.arena, built.arena)
    # control: the plain store of the same checkpoint is other bytes
    plain, _ = build_store(str(tmp_path / "plain"), progress=False)
    assert plain.nbytes != renested.nbytes


@requires_bitsandbytes
def test_the_export_of_a_double_quantized_store_loads_double_quantized(tmp_path):
    """export_bnb4bit writes the nested state: transformers + bitsandbytes (what the Unsloth method loads)
    read it into the store's very tensors, and poros reads it back into the same arena."""
    import json

    from safetensors.torch import load_file

    from poros.store.export import export_bnb4bit

    store, _ = build_store("tiny-qwen3", progress=False, double_quant=True)
    folder = export_bnb4bit(store, tmp_path / "export")
    q = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert q["bnb_4bit_use_double_quant"] is True
    saved = {}
    for f in folder.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    expected = slot_state(store)
    got = {}
    for slot in store.slots():
        got[f"{slot.name}.weight"] = saved[f"{slot.name}.weight"]
        got[f"{slot.name}.absmax"] = saved[f"{slot.name}.weight.absmax"]
        got[f"{slot.name}.nested_absmax"] = saved[f"{slot.name}.weight.nested_absmax"]
    assert_all_equal("export", {k: v for k, v in expected.items() if not k.endswith(".offset")}, got)
    back, _ = build_store(str(folder), progress=False, double_quant=True)
    assert torch.equal(back.arena, store.arena), "the export read back is other bytes"
    bnb = _bnb_model(folder, double=True)
    modules = dict(bnb.named_modules())
    for slot in store.slots():
        state = modules[slot.name].weight.quant_state
        t = slot_tensors(store.arena, slot)
        assert state.nested and torch.equal(state.absmax, t.absmax) and torch.equal(state.state2.absmax,
                                                                                     t.nested_absmax), slot.name
        assert torch.equal(state.offset, t.offset), slot.name
