"""Write an NF4 store as a pre-quantized bitsandbytes 4-bit Hugging Face checkpoint folder.

The folder (config.json with a bitsandbytes quantization_config, one safetensors shard per decoder
layer plus one for the dense weights, an index, and a small word-level tokenizer) loads with
`from_pretrained(..., load_in_4bit=True)` into exactly the store's NF4 bytes (double-quantized where the
store is). Written layer by
layer, at NF4 size: a quarter of the bf16 checkpoint, which for a large model may not fit the disk; into a temporary
folder beside the target, renamed once whole (`poros.common.atomic.atomic_folder`), so a full disk or a kill leaves
no folder that looks like a checkpoint.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from poros.common.atomic import atomic_folder
from poros.errors import PorosError
from poros.store.arena import NF4Store, slot_tensors
from poros.store.quantize import quant_state

TOKENIZER_VOCAB = 4096  # a stand-in tokenizer: the synthetic dataset feeds token ids directly


def _quant_tensors(store: NF4Store, slot) -> dict[str, torch.Tensor]:
    """The packed weight and its quant state (with double quantization the nested state) as bitsandbytes
    saves them."""
    t = slot_tensors(store.arena, slot)
    state = quant_state(t, store.code.clone(), store.nested_code, slot.shape)
    out = {f"{slot.name}.weight": t.weight}
    out.update({f"{slot.name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    return {k: v.contiguous() for k, v in out.items()}


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = min(vocab_size, TOKENIZER_VOCAB)
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, n)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(str(folder))


def export_bnb4bit(store: NF4Store, folder: str | Path, *, progress=None) -> Path:
    """Write `store` to `folder` (absent or empty) as a bitsandbytes NF4 checkpoint; returns the folder.

    Raises:
        PorosError: `folder` holds files.
        WriteError: a file could not be written (a full disk, a file-size limit): `folder` is as it was.
    """
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise PorosError(f"{folder} exists and is not an empty folder; the NF4 checkpoint is written into a new one")
    with atomic_folder(folder, "the NF4 checkpoint", "nothing of it is left behind") as tmp:
        _write(store, tmp, progress)
    return folder


def _write(store: NF4Store, folder: Path, progress) -> None:
    """The checkpoint's files, written into `folder`."""
    from safetensors.torch import save_file

    config = copy.deepcopy(store.config)
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, 2
    config.use_cache = False
    config.quantization_config = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": "bfloat16",
        "bnb_4bit_use_double_quant": store.double_quant,
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": ["lm_head"],
    }
    config.save_pretrained(str(folder))
    weight_map: dict[str, str] = {}
    total = len(store.layers) + 1
    for i, layer in enumerate(store.layers):
        shard = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        tensors = {}
        for slot in layer.slots:
            tensors.update(_quant_tensors(store, slot))
        prefix = layer.slots[0].name.rsplit(".", 2)[0] if layer.slots else None
        for name, t in (*store.dense.items(), *store.buffers.items()):
            if prefix and name.startswith(prefix.rsplit(".", 1)[0] + f".{i}."):
                tensors[name] = t.contiguous()
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
        if progress:
            progress(i + 1, total)
    shard = f"model-{total:05d}-of-{total:05d}.safetensors"
    rest = {k: v.contiguous() for k, v in store.dense.items() if k not in weight_map}
    save_file(rest, str(folder / shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in rest})
    size = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=1))
    _write_tokenizer(folder, config.vocab_size)
