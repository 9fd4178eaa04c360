"""Which SDPA backend does torch pick for the registered models' attention, and is its backward repeatable?

    python3 experiments/h200-attention-repeatability/probe_attention.py [--repeats 8] [--seq 512]

For each registry shape (attention heads, key/value heads, head dim) and each backend, runs the
attention call transformers makes at batch 1 without padding (is_causal, enable_gqa) forward and
backward `repeats` times on the same inputs, half of them while a large host->device copy runs on
a side stream (as poros's streaming does), and prints one JSON line: the backend torch's default
dispatch chooses, and for each backend whether dq/dk/dv were bitwise equal on every repeat.
A GPU probe for the notes, not a test.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from poros.models.shapes import SHAPES

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def run(q, k, v, go, backend):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(go)
    return [out.detach(), q.grad, k.grad, v.grad]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args()
    dev = torch.device("cuda")
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    sink = torch.empty_like(host, device=dev)
    side = torch.cuda.Stream()
    for name, shape in SHAPES.items():
        if shape.tiny:
            continue
        c = shape.config()
        layers = getattr(c, "per_layer_config", None) or [c]
        seen = set()
        for lc in layers:  # gemma4: sliding and full layers differ in head_dim / kv heads
            heads, kv = lc.num_attention_heads, lc.num_key_value_heads
            hd = getattr(lc, "head_dim", None) or c.hidden_size // heads
            if (heads, kv, hd) not in seen:
                seen.add((heads, kv, hd))
                probe(name, heads, kv, hd, args, dev, host, sink, side)


def make(h: int, hd: int, seq: int, dev, g) -> torch.Tensor:
    return torch.randn(1, h, seq, hd, device=dev, dtype=torch.bfloat16, generator=g)


def probe(name, heads, kv, hd, args, dev, host, sink, side) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (make(h, hd, args.seq, dev, g) for h in (heads, kv, kv))
    go = make(heads, hd, args.seq, dev, g)
    row = {"model": name, "heads": heads, "kv_heads": kv, "head_dim": hd}
    try:
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)
        row["default_choice"] = SDPBackend(choice).name
    except (RuntimeError, TypeError, AttributeError, ValueError) as e:  # private API: report, do not fail
        row["default_choice"] = f"unknown ({type(e).__name__})"
    for bname, backend in BACKENDS.items():
        try:
            ref = run(q, k, v, go, backend)
            same = True
            for r in range(args.repeats):
                if r % 2:
                    with torch.cuda.stream(side):
                        sink.copy_(host, non_blocking=True)
                got = run(q, k, v, go, backend)
                same &= all(torch.equal(a, b) for a, b in zip(ref, got))
            torch.cuda.synchronize()
            row[bname] = "repeatable" if same else "NOT repeatable"
        except RuntimeError as e:
            row[bname] = f"unavailable: {str(e).splitlines()[0][:80]}"
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
