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


# a CPU matrix of one tiny model, poros against resident, one step of one pass: what tests of matrix files change
TINY_MATRIX = dict(name="tiny", steps=1, passes=1, warmup_passes=0, seq_len=64, batch_size=1, grad_accum=1,
                   lora_rank=4, lora_alpha=8, block_size=2, dataset="synthetic", device="cpu", stacks=["current"],
                   parity_steps=1, methods=["poros", "resident"], models=["tiny-qwen2"])


def tiny_matrix(tmp_path, **changes) -> str:
    """A matrix file in `tmp_path`: TINY_MATRIX with `changes`, under a name no earlier call there took."""
    import yaml

    path = tmp_path / f"m{len(list(tmp_path.glob('m*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({**TINY_MATRIX, **changes}))
    return str(path)
