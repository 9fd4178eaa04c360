"""Flash attention's forward and backward time under strict determinism and without it (a probe, not a test).

    python3 experiments/h200-attention-determinism-64k/probe_attention_time.py --seq-lens 32768,65536 --out probe.jsonl

One decoder layer's attention core of qwen2.5-72b (64 query heads, 8 key/value heads, head size 128, bf16, causal),
through SDPA's flash backend as a layer calls it (key/value heads repeated, as `repeat_kv` does, and with
`enable_gqa`): the median of a few timed repeats after one untimed, each timed with CUDA events. One JSON line per
seq_len × determinism × GQA form.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from poros.finetune.samples import write_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from dequant_speed import time_us  # noqa: E402  (one CUDA-event timer for the probes)

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128


def measure(seq: int, deterministic: bool, gqa: bool, repeats: int) -> dict:
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    kv_heads = KV_HEADS if gqa else HEADS
    k = torch.randn(1, kv_heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    grad = torch.randn(1, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)

    def forward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def forward_only():
        with torch.no_grad():
            forward()

    out = forward()

    def backward():
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    row = {"seq_len": seq, "deterministic": deterministic, "enable_gqa": gqa,
           "forward_s": round(time_us(forward_only, repeats) / 1e6, 4),
           "backward_s": round(time_us(backward, repeats) / 1e6, 4)}
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", default="32768,65536")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for gqa in (False, True):
            for deterministic in (True, False):
                try:
                    row = measure(seq, deterministic, gqa, args.repeats)
                    torch.cuda.empty_cache()  # the last shape's tensors, freed with measure's frame
                except RuntimeError as e:  # a backend that refuses the shape
                    row = {"seq_len": seq, "deterministic": deterministic, "enable_gqa": gqa, "error": str(e)[:300]}
                row.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
