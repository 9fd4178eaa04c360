"""One decoder layer's attention core, forward and backward, per backend and sequence length: its time and whether its
backward repeats bit for bit (a probe for the attention setting, not a test).

    python3 scripts/attention_probe.py --seq-lens 4096,16384,32768,65536 --out attention.jsonl [--max-minutes 8]

qwen2.5-72b's attention (64 query heads, 8 key/value heads, head size 128, bf16, causal, batch 1), the key/value heads
grouped as a layer calls SDPA with `enable_gqa`. Candidates:
  sdpa-flash, sdpa-efficient, sdpa-cudnn   PyTorch's SDPA backends, each with strict determinism on and off
  flex                                     FlexAttention (torch.compile's generated kernels), a causal block mask
Each case: one untimed call, then the median of `--repeats` calls timed with CUDA events, forward alone and backward
alone (the backward of one retained forward); then two more backwards whose dq, dk, dv are compared with torch.equal
(`repeats`: the bits repeat). One JSON line per case, to stdout and `--out`; a backend that refuses a case records
its error. `--max-minutes` starts no case past that time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from poros.finetune.samples import write_jsonl
from poros.provenance import provenance

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 128
SDPA = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def _timed(fn, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn`, after one untimed call, each between two CUDA events."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _attention(backend: str, seq: int):
    """The attention call of `backend` on (q, k, v)."""
    if backend in SDPA:
        def call(q, k, v):
            with sdpa_kernel(SDPA[backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return call
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq, seq, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def measure(backend: str, seq: int, deterministic: bool, repeats: int) -> dict:
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = lambda heads: (1, heads, seq, HEAD_DIM)  # noqa: E731
    q = torch.randn(shape(HEADS), device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(shape(KV_HEADS), device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(shape(KV_HEADS), device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    grad = torch.randn(shape(HEADS), device="cuda", dtype=torch.bfloat16, generator=g)
    attend = _attention(backend, seq)

    def forward_only():
        with torch.no_grad():
            attend(q, k, v)

    out = attend(q, k, v)

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    row = {"backend": backend, "seq_len": seq, "deterministic": deterministic,
           "forward_s": round(_timed(forward_only, repeats), 4), "backward_s": round(_timed(backward, repeats), 4)}
    first, second = backward(), backward()
    row["repeats"] = all(torch.equal(a, b) for a, b in zip(first, second))
    # the backward's arithmetic: 2.5x the forward's 4 * seq^2 * heads * head_dim / 2 (causal) multiply-adds
    row["backward_tflops"] = round(2.5 * 2 * seq * seq * HEADS * HEAD_DIM / row["backward_s"] / 1e12, 1)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", default="4096,16384,32768,65536")
    p.add_argument("--backends", default="sdpa-flash,sdpa-cudnn,sdpa-efficient,flex")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--out")
    args = p.parse_args()
    stop = None if args.max_minutes is None else time.monotonic() + args.max_minutes * 60
    meta = {k: v for k, v in provenance().items() if k in ("gpus", "versions", "cuda", "cudnn", "git")}
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for backend in args.backends.split(","):
            for deterministic in (True, False):
                if stop is not None and time.monotonic() > stop:
                    break
                try:
                    row = measure(backend, seq, deterministic, args.repeats)
                except (RuntimeError, NotImplementedError) as e:  # a backend that refuses the case
                    row = {"backend": backend, "seq_len": seq, "deterministic": deterministic,
                           "error": f"{type(e).__name__}: {e}"[:300]}
                torch.cuda.empty_cache()
                row.update(meta)
                print(json.dumps({k: v for k, v in row.items() if k not in meta}), flush=True)
                rows.append(row)
                if args.out:
                    write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
