"""`poros generate`: a few greedy tokens from a base and a trained adapter, to eyeball a run."""

from __future__ import annotations

import sys

from poros.errors import ConfigError
from poros.paths import path_arg

EPILOG = """examples:
  poros generate --model ./Qwen3-32B --adapter runs/qwen3/adapter --prompt "What is 12 plus 30?" --chat
  poros generate --model ./tiny --adapter runs/tiny/adapter --prompt "The cat" --max-new-tokens 20 --device cpu
  poros generate --model ./tiny --prompt "The cat"        # the base alone, to compare

The base loads in NF4 as training held it (--bf16: as stored); greedy decoding, so a call repeats. It
stops at the tokenizer's end-of-sequence token or at the model's last position (max_position_embeddings).
--adapter is refused where its run recorded another base, or where its shapes do not fit --model.
Prints the generated text (the prompt and the end-of-sequence token left out) on stdout.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample a few tokens from base + adapter (greedy)", epilog=EPILOG)
    p.add_argument("--model", required=True, type=path_arg, help="the base checkpoint folder the run trained on")
    p.add_argument("--adapter", type=path_arg, help="the run's adapter folder, RUN/adapter (default: none, the base alone)")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=20, metavar="N", help="tokens to generate (default: 20)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the tokenizer's chat "
                                                       "template")
    p.add_argument("--bf16", action="store_true", help="load the base as stored instead of quantizing it to NF4")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from poros.finetune.merge import generate

    if not 0 < args.max_new_tokens <= 1 << 20:
        raise ConfigError([f"expected an integer from 1 to {1 << 20}, got {args.max_new_tokens}"], "--max-new-tokens")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    text = generate(args.model, args.adapter, args.prompt, max_new_tokens=args.max_new_tokens, device=device,
                    nf4=not args.bf16, chat=args.chat, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(text, flush=True)
    return 0
