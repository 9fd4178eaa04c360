"""A tiny bf16 checkpoint and data to try `poros train`, `export` and `generate` on a CPU, nothing from a hub.

    python3 scripts/tiny_checkpoint.py out/tiny                      # tiny-qwen2
    python3 scripts/tiny_checkpoint.py out/tiny-gemma3 --model tiny-gemma3

Writes OUT/model/ (a registered tiny shape, seeded, as a bf16 Hugging Face checkpoint: config.json, safetensors and
a byte-level BPE tokenizer with a chat template, trained on the data) and OUT/data.jsonl (generated text records
and arithmetic chats: poros/finetune/samples.py). A bf16 base is what `poros export --merge` merges into; an NF4
checkpoint (scripts/train_gpu_check.py writes one) trains and generates alike but cannot be merged. Refuses an
OUT that already holds either, so nothing is overwritten. Prints the paths it wrote.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from poros.finetune.samples import generated_chats, generated_texts, tiny_checkpoint, write_jsonl
from poros.models.shapes import SHAPES

TEXTS = 1000  # records of generated text; a third as many chats come after them


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder to write model/ and data.jsonl into")
    tiny = [name for name in SHAPES if name.startswith("tiny-")]
    p.add_argument("--model", default="tiny-qwen2", choices=tiny, help="registered tiny shape (default tiny-qwen2)")
    args = p.parse_args(argv)
    model, data = args.out / "model", args.out / "data.jsonl"
    there = [str(x) for x in (model, data) if x.exists()]
    if there:
        print(f"tiny_checkpoint: {' and '.join(there)} exist already; remove them or name another folder",
              file=sys.stderr)
        return 2
    model.mkdir(parents=True)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one shard of a few MB: no bar to watch
    texts = generated_texts(TEXTS, seed=0)
    tiny_checkpoint(model, args.model, texts)
    write_jsonl(data, [{"text": t} for t in texts] + [{"messages": m} for m in generated_chats(TEXTS // 3, seed=0)])
    print(f"wrote {model}/ ({args.model}, bf16, with its tokenizer) and {data} ({TEXTS} texts, {TEXTS // 3} chats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
