"""One decoder layer's attention core, forward and backward, per backend and sequence length: its time and whether its
backward repeats bit for bit (a probe for the attention setting, not a test).

    python3 scripts/attention_probe.py --seq-lens 4096,16384,32768,65536 --out attention.jsonl [--max-minutes 8]

qwen2.5-72b's attention (64 query heads, 8 key/value heads, head size 128, bf16, causal, batch 1), laid out as a
decoder layer hands it over (its projections' batch x seqlen x heads x head_dim, transposed to SDPA's batch x heads
x seqlen x head_dim), the key/value heads grouped as a layer calls SDPA with `enable_gqa`. Candidates:
  sdpa-flash, sdpa-efficient, sdpa-cudnn   PyTorch's SDPA backends, each with strict determinism on and off
  flex                                     FlexAttention (torch.compile's generated kernels), a causal block mask
  fa4, fa4-atomic                          FlashAttention-4 as `attention: fa4` calls it (poros/engine/model/fa4.py:
                                           the same routing, layout conversions and custom ops), its deterministic
                                           backward (fa4, strict determinism on) and its atomic one (fa4-atomic, off)
Each case: one untimed call, then the median of `--repeats` calls timed with CUDA events, forward alone and backward
alone (the backward of one retained forward); then two more backwards whose dq, dk, dv are compared with torch.equal
(`repeats`: the bits repeat). FA4's rows add `vs_sdpa_flash` (the largest difference of out, dq, dk, dv from SDPA
flash's, relative to the largest value of SDPA's) and `graph` (a forward and backward captured in a CUDA graph after
the timed calls, replayed: `replays the eager bits`, `differs from eager` or the capture's error). One JSON line per
case, to stdout and `--out`; a backend that refuses a case, or whose package does not import, records its error
and the probe goes on. `--max-minutes` starts no case past that time.
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
FA4 = {"fa4": True, "fa4-atomic": False}  # FA4's candidates, each with the strict determinism it runs under


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
    if backend in FA4:
        from poros.choices import Attention
        from poros.engine.model import fa4
        from poros.engine.model.attention import sdpa_context

        fa4.KERNEL.interface()  # flash_attn.cute imported now: a missing package is this case's error

        def routed(q, k, v):
            if not fa4.serves(q, k, v, is_causal=True, enable_gqa=True):
                raise RuntimeError(f"attention fa4 does not route this call to FA4 (q {tuple(q.shape)} {q.dtype})")
            with sdpa_context(Attention.FA4):  # as a layer's call on `attention: fa4` runs
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return routed
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq, seq, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def _inputs(seq: int):
    """q, k, v as a decoder layer hands them to SDPA, and the output's gradient."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def layer(heads: int, grad: bool = True):  # batch x seqlen x heads x head_dim, transposed
        t = torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        return t.requires_grad_(grad)

    return layer(HEADS), layer(KV_HEADS), layer(KV_HEADS), layer(HEADS, grad=False)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _against_flash(attend, q, k, v, grad) -> dict:
    """The largest differences of out, dq, dk, dv from SDPA flash's on the same inputs, relative to SDPA's."""
    out = attend(q, k, v)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
    return {name: round(_relative(a, b), 6) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def _graph(attend, q, k, v, grad) -> str:
    """A forward and backward captured in a CUDA graph (after a call on a side stream, as PyTorch's examples warm
    up), replayed, against the eager bits."""
    try:
        eager = torch.autograd.grad(attend(q, k, v), (q, k, v), grad)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.autograd.grad(attend(q, k, v), (q, k, v), grad)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.autograd.grad(attend(q, k, v), (q, k, v), grad)
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(eager, captured))
        del graph
        return "replays the eager bits" if same else "differs from eager"
    except Exception as e:  # the capture's refusal is the finding
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {e}"[:300]


def measure(backend: str, seq: int, deterministic: bool, repeats: int) -> dict:
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    q, k, v, grad = _inputs(seq)
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
    if backend in FA4:
        del first, second, out
        row["vs_sdpa_flash"] = _against_flash(attend, q, k, v, grad)
        row["graph"] = _graph(attend, q, k, v, grad)
    return row


def cases(backends: list[str]) -> list[tuple[str, bool]]:
    """(backend, strict determinism) in order: FA4's candidates each in their own mode, the others in both."""
    return [(b, d) for b in backends for d in ((FA4[b],) if b in FA4 else (True, False))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-lens", default="4096,16384,32768,65536")
    p.add_argument("--backends", default="sdpa-flash,sdpa-cudnn,sdpa-efficient,flex,fa4,fa4-atomic")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--out")
    args = p.parse_args()
    stop = None if args.max_minutes is None else time.monotonic() + args.max_minutes * 60
    meta = {k: v for k, v in provenance().items() if k in ("gpus", "versions", "cuda", "cudnn", "git")}
    try:
        from importlib.metadata import version

        meta["versions"] = {**meta.get("versions", {}), "flash-attn-4": version("flash-attn-4"),
                            "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl")}
    except Exception:  # not installed: its cases record why
        pass
    rows = []
    for seq in (int(s) for s in args.seq_lens.split(",")):
        for backend, deterministic in cases(args.backends.split(",")):
            if stop is not None and time.monotonic() > stop:
                break
            try:
                row = measure(backend, seq, deterministic, args.repeats)
            except Exception as e:  # a backend that refuses the case, or whose package does not import
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
