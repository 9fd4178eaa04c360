"""Tiny checkpoints with real tokenizers, built locally (nothing from a hub), and the CLI's refusal contract.

    texts = generated_texts(200)                       # poros.finetune.samples
    tiny_checkpoint(folder, "tiny-qwen2", texts)       # bf16 safetensors + config.json + BPE tokenizer
"""

from __future__ import annotations

from pathlib import Path

import torch

from poros.finetune.samples import generated_texts, train_tokenizer


def tiny_checkpoint(folder: str | Path, model: str = "tiny-qwen2", texts: list[str] | None = None, *,
                    seed: int = 0, chat_template: bool = True, vocab_size: int = 512) -> Path:
    """A seeded registered shape saved as a bf16 Hugging Face checkpoint (config.json + safetensors),
    with a tokenizer trained on `texts` (default: `generated_texts(200)`) in the same folder."""
    import transformers

    from poros.models.shapes import get_shape

    folder = Path(folder)
    config = get_shape(model).config()
    tok = train_tokenizer(folder, texts if texts is not None else generated_texts(200), vocab_size=vocab_size,
                          chat_template=chat_template)
    assert len(tok) <= config.vocab_size, f"tokenizer of {len(tok)} tokens exceeds {model}'s vocabulary"
    config.eos_token_id = config.pad_token_id = tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(str(folder))
    return folder


def one_line_refusal(capsys, code: int, *named: str) -> str:
    """A command refused bad input as the CLI promises: exit 2, one line on stderr naming every part of
    `named`, no traceback, nothing on stdout. Returns the line."""
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stderr: {err[-2000:]}"
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line on stderr, got {lines}"
    for part in named:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    assert out == ""
    return lines[0]
