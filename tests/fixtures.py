"""Tiny checkpoints with real tokenizers, built locally (nothing from a hub), and the CLI's refusal contract.

    texts = generated_texts(200)                       # poros.finetune.samples
    tiny_checkpoint(folder, "tiny-qwen2", texts)       # poros.finetune.samples: bf16 safetensors + BPE tokenizer
"""

from __future__ import annotations

from poros.finetune.samples import tiny_checkpoint  # noqa: F401  (the tests' tiny checkpoints)


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
