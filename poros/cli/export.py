"""`poros export --merge`: a trained adapter merged into its base, as a bf16 checkpoint transformers loads alone."""

from __future__ import annotations

import json
import sys

from poros.errors import ConfigError
from poros.paths import path_arg

EPILOG = """examples:
  poros export --merge --model ./Qwen3-32B --adapter runs/qwen3/adapter --out ./Qwen3-32B-tuned
  poros export --merge --model ./tiny --adapter runs/tiny/checkpoint/adapter --out ./tiny-merged

--model is the bf16 (or fp16/fp32) checkpoint the run trained on; each weight with an adapter becomes
bf16(W + alpha/r * B @ A), the bits peft's merge_and_unload gives on a bf16 base; the rest is cast to bf16.
The adapter is refused where its run (RUN/config.json) recorded other base weights, where its tensors'
rank is not adapter_config.json's r, or where its shapes do not fit --model.
Written one shard at a time into OUT.partial, then renamed. Then:
  AutoModelForCausalLM.from_pretrained("./Qwen3-32B-tuned", dtype=torch.bfloat16)
Prints one JSON line; exit 0 when written, 2 on bad input.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="merge a trained adapter into its base (bf16 checkpoint out)", epilog=EPILOG)
    p.add_argument("--merge", action="store_true", help="merge the adapter into the base weights (the one export "
                                                        "this command makes; required, so the call says what it does)")
    p.add_argument("--model", required=True, type=path_arg, help="the base checkpoint folder the run trained on")
    p.add_argument("--adapter", required=True, type=path_arg, help="the run's adapter folder (RUN/adapter)")
    p.add_argument("-o", "--out", required=True, type=path_arg, help="new (or empty) folder for the merged checkpoint")
    p.set_defaults(run=run)


def run(args) -> int:
    from poros.finetune.merge import merge_adapter

    if not args.merge:
        raise ConfigError(["give --merge (the merged bf16 checkpoint is what export writes)"], "poros export")
    out = merge_adapter(args.model, args.adapter, args.out, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(json.dumps({"merged": str(out), "model": args.model, "adapter": args.adapter}), flush=True)
    return 0
