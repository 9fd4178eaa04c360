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

from poros.errors import CheckpointError, ConfigError
from poros.finetune.data import TOKENIZER_META

PEFT_PREFIX = "base_model.model."
COPIED = (*TOKENIZER_META, "generation_config.json", "added_tokens.json")


def _adapter(adapter: Path) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's scaling and, by the base's weight name, its (A, B) pair."""
    from safetensors.torch import load_file

    cfg_path, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise CheckpointError(f"{adapter}: not a peft adapter folder (adapter_config.json and "
                              "adapter_model.safetensors); pass RUN/adapter of a finished run")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type") != "LORA" or cfg.get("fan_in_fan_out"):
        raise CheckpointError(f"{adapter}: a {cfg.get('peft_type')} adapter; merging takes LoRA adapters of "
                              "nn.Linear layers")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r
    pairs: dict[str, list] = {}
    for key, t in load_file(str(weights)).items():
        for part, i in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.startswith(PEFT_PREFIX) and key.endswith(part):
                pairs.setdefault(key[len(PEFT_PREFIX) : -len(part)] + ".weight", [None, None])[i] = t
    broken = [k for k, (a, b) in pairs.items() if a is None or b is None]
    if broken or not pairs:
        raise CheckpointError(f"{adapter}: {'no LoRA weights' if not pairs else f'lora_A or lora_B missing for {broken[:3]}'}")
    return scaling, {k: (a, b) for k, (a, b) in pairs.items()}


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`w` with the LoRA update folded in, in bf16: peft's merge on a bf16 base (fp32 delta, one rounding)."""
    delta = (b.float() @ a.float()) * scaling
    return (w.float() + delta).to(torch.bfloat16)


def merge_adapter(model: str | Path, adapter: str | Path, out: str | Path, say=lambda s: None) -> Path:
    """Write `model` (a bf16/fp16/fp32 safetensors checkpoint folder) with `adapter` merged into `out`
    as a bf16 checkpoint: config, shards of the same names, index and tokenizer files. Written into
    `out.partial` and renamed, so `out` is whole or absent.

    Raises:
        ConfigError: `out` exists and is not empty.
        CheckpointError: a quantized base, an adapter that names weights the base lacks.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    model, adapter, out = Path(model), Path(adapter), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError([f"{out} exists and is not an empty folder; choose a new --out"], "--out")
    config_path = model / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{model}: no config.json; pass the checkpoint folder the run trained on")
    config = json.loads(config_path.read_text())
    if config.get("quantization_config"):
        raise CheckpointError(f"{model} is a quantized ({config['quantization_config'].get('quant_method')}) "
                              "checkpoint; merge into the bf16 checkpoint it was quantized from")
    shards = sorted(model.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model}: no safetensors weight files")
    scaling, pairs = _adapter(adapter)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        done = set()
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
                        done.add(name)
                    elif t.is_floating_point():
                        t = t.to(torch.bfloat16)
                    tensors[name] = t.contiguous()
            save_file(tensors, str(tmp / shard.name), metadata={"format": "pt"})
            say(f"merged {shard.name} ({i}/{len(shards)})")
        missing = sorted(set(pairs) - done)
        if missing:
            raise CheckpointError(f"{adapter}: adapts {len(missing)} weights {model} does not have (e.g. "
                                  f"{missing[0]}); pass the checkpoint the run trained on")
        config["torch_dtype"] = config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for f in model.iterdir():
            if f.name in COPIED or f.name.endswith(".safetensors.index.json"):
                shutil.copy(f, tmp / f.name)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def generate(model: str | Path, adapter: str | Path | None, prompt: str, *, max_new_tokens: int = 20,
             device: str = "cpu", nf4: bool = True, chat: bool = False) -> str:
    """Greedy continuation of `prompt` by base `model` + `adapter` (None: the base alone), with the
    base in NF4 as training held it (`nf4`; a bitsandbytes checkpoint is NF4 anyway) or as stored."""
    import transformers

    from poros.finetune.data import load_tokenizer

    tok = load_tokenizer(model)
    kwargs = {"dtype": torch.bfloat16, "device_map": {"": device}}
    config = json.loads((Path(model) / "config.json").read_text())
    if nf4 and not config.get("quantization_config"):
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    lm = transformers.AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    if adapter is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, str(adapter))
    lm.eval()
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ConfigError([f"{model}: the tokenizer has no chat template; leave out --chat"], "--chat")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = lm.generate(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                          if tok.pad_token_id is not None else tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)
