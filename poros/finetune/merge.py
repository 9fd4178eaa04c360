"""After `poros train`: the adapter merged into its base as a bf16 checkpoint `transformers` loads alone
(`poros export --merge`), and a few greedy tokens from base + adapter (`poros generate`).

The merge streams the base one safetensors shard at a time (a 72B is never whole in host memory):
each targeted weight becomes `bf16(W + scaling * (B @ A))`, computed in fp32 as peft's own
`merge_and_unload` computes it on a bf16 base, so the merged weights are peft's bit for bit. A merged
model's logits are not the unmerged model's bits: the sum is rounded to bf16 once per weight, where
the unmerged model adds the adapter's output to the base's at run time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from poros.common.atomic import atomic_folder
from poros.errors import CheckpointError, ConfigError
from poros.finetune.adapter import check_base, check_shapes, read_adapter
from poros.finetune.tokenizing import TOKENIZER_META
from poros.models.checkpoint import CheckpointReader, resolve

COPIED = (*TOKENIZER_META, "generation_config.json", "added_tokens.json")


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`w` with the LoRA update folded in, in bf16: peft's merge on a bf16 base (fp32 delta, one rounding)."""
    delta = (b.float() @ a.float()) * scaling
    return (w.float() + delta).to(torch.bfloat16)


def base_checkpoint(model: Path):
    """The base checkpoint folder as a Source, its weight files checked readable before any work (a truncated
    shard is named here, not as a traceback half way through).

    Raises:
        CheckpointError: not a checkpoint folder, or a weight file that does not open.
    """
    src = resolve(str(model))
    if src.checkpoint is None:
        raise CheckpointError(f"{model} is a registered shape, with no weights; pass the checkpoint folder the run "
                              "trained on")
    CheckpointReader(src.checkpoint).check_readable()
    return src


def merge_adapter(model: str | Path, adapter: str | Path, out: str | Path, say=lambda s: None) -> Path:
    """Write `model` (a bf16/fp16/fp32 safetensors checkpoint folder) with `adapter` merged into `out`
    as a bf16 checkpoint: config, shards of the same names, index and tokenizer files. Written into a temporary
    folder beside it and renamed (`poros.common.atomic.atomic_folder`), so `out` is whole or absent.

    Raises:
        ConfigError: `out` exists and is not empty.
        CheckpointError: a quantized base, an adapter that names weights the base lacks.
        WriteError: the merged checkpoint could not be written (a full disk, a file-size limit).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, out = Path(model), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError([f"{out} exists and is not an empty folder; choose a new --out"], "--out")
    src = base_checkpoint(model)
    config = json.loads((model / "config.json").read_text())
    if config.get("quantization_config"):
        raise CheckpointError(f"{model} is a quantized ({config['quantization_config'].get('quant_method')}) "
                              "checkpoint; merge into the bf16 checkpoint it was quantized from")
    shards = sorted(model.glob("*.safetensors"))
    found = read_adapter(adapter)
    check_shapes(found, model, src.config)
    stored = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            stored.update(f.keys())
    missing = sorted(set(found.pairs) - stored)
    if missing:
        raise CheckpointError(f"{found.folder}: adapts {len(missing)} weights {model} does not have (e.g. "
                              f"{missing[0]}); pass the checkpoint the run trained on")
    check_base(found, model, say)
    adapter, scaling, pairs = found.folder, found.scaling, found.pairs
    with atomic_folder(out, "the merged checkpoint", "nothing of it is left behind") as tmp:
        for i, shard in enumerate(shards, 1):
            tensors = {}
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if name in pairs:
                        a, b = pairs[name]
                        if (b.shape[0], a.shape[1]) != tuple(t.shape):
                            raise CheckpointError(f"{adapter}: adapts {name} as {b.shape[0]} x {a.shape[1]}, but "
                                                  f"{model} does not have it in that shape ({tuple(t.shape)}); pass "
                                                  "the checkpoint the run trained on")
                        t = merged_weight(t, a, b, scaling)
                    elif t.is_floating_point():
                        t = t.to(torch.bfloat16)
                    tensors[name] = t.contiguous()
            save_file(tensors, str(tmp / shard.name), metadata={"format": "pt"})
            say(f"merged {shard.name} ({i}/{len(shards)})")
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in model.iterdir():
            if f.name in COPIED or f.name.endswith(".safetensors.index.json"):
                shutil.copy(f, tmp / f.name)
    return out


def prompt_ids(tok, prompt: str, *, chat: bool, model: Path, vocab_size: int) -> torch.Tensor:
    """The prompt as token ids (1, n), as the model reads it (with --chat, the tokenizer's template).

    Raises:
        ConfigError: a prompt of no tokens, a template the tokenizer lacks.
        CheckpointError: a token id beyond the model's embeddings (the tokenizer is another model's).
    """
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError([f"{model}: the tokenizer has no chat template; leave out --chat"], "--chat")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise ConfigError([f"{prompt!r} is no tokens to continue; give some text"], "--prompt")
    top = int(ids.max())
    if top >= vocab_size:
        raise CheckpointError(f"{model}: the tokenizer gives the prompt token id {top}, beyond the model's "
                              f"{vocab_size} embeddings; the tokenizer files do not belong to this checkpoint")
    return ids


def new_tokens_cap(config, prompt_len: int, wanted: int, model: Path, say) -> int:
    """`wanted` new tokens, capped where prompt + continuation would pass the model's positions (said once).

    Raises:
        ConfigError: the prompt alone fills them.
    """
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or prompt_len + wanted <= limit:
        return wanted
    if prompt_len >= limit:
        raise ConfigError([f"the prompt is {prompt_len} tokens, and {model} reads at most {limit} "
                           "(max_position_embeddings); shorten it"], "--prompt")
    say(f"note: --max-new-tokens {wanted} capped at {limit - prompt_len}: the prompt's {prompt_len} tokens and "
        f"the continuation fill {model}'s {limit} positions (max_position_embeddings)")
    return limit - prompt_len


def generate(model: str | Path, adapter: str | Path | None, prompt: str, *, max_new_tokens: int = 20,
             device: str = "cpu", nf4: bool = True, chat: bool = False, say=lambda s: None) -> str:
    """Greedy continuation of `prompt` by base `model` + `adapter` (None: the base alone), with the
    base in NF4 as training held it (`nf4`; a bitsandbytes checkpoint is NF4 anyway) or as stored.
    It stops at the tokenizer's end-of-sequence token (not printed) or the model's last position.

    Raises:
        ConfigError, CheckpointError: bad input, before the model is loaded.
    """
    import transformers

    from poros.finetune.tokenizing import load_tokenizer

    model = Path(model)
    src = base_checkpoint(model)
    tok = load_tokenizer(model)
    ids = prompt_ids(tok, prompt, chat=chat, model=model, vocab_size=src.config.vocab_size)
    max_new_tokens = new_tokens_cap(src.config, ids.shape[1], max_new_tokens, model, say)
    found = None
    if adapter is not None:
        found = read_adapter(adapter)
        check_shapes(found, model, src.config)
        check_base(found, model, say)
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": device}}
    config = json.loads((model / "config.json").read_text())
    if nf4 and not config.get("quantization_config"):
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    if found is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, str(found.folder))
    lm.eval()
    eos = tok.eos_token_id
    with torch.no_grad():
        out = lm.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    new = out[0, ids.shape[1]:].tolist()
    if new and eos is not None and new[-1] == eos:
        new = new[:-1]
    return tok.decode(new, skip_special_tokens=False)
