"""Which sliding-window attention calls the memory-efficient SDPA backend serves under strict determinism.

    python3 experiments/h200-sliding-window/probe_sliding_window.py > probe_sliding_window.jsonl

Gemma3-27B's attention shape (32 query heads, 16 key/value heads, head dim 128, bf16) with a 1024-token
sliding-window causal mask, as a bool and as an additive float mask, at 1100 (not a multiple of 8), 1104
and 2048 tokens: key/value heads repeated to the query heads (what transformers does when it passes a
mask), passed with `enable_gqa=True`, and equal heads. Forward and backward on memory-efficient alone; one
JSON line per call: "ok", or the error and the reasons torch warned. A GPU probe for the notes, not a test.
"""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WINDOW = 1024


def sliding_mask(seq: int, kind: str) -> torch.Tensor:
    i = torch.arange(seq, device="cuda")
    allowed = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < WINDOW))[None, None]
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for seq in (1100, 1104, 2048):
        for kind in ("bool", "float"):
            for heads in ((32, 16), (32, 32)):
                q = torch.randn(1, heads[0], seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(1, heads[1], seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn_like(k, requires_grad=True)
                mask = sliding_mask(seq, kind)
                for gqa in (False, True):
                    if heads[0] == heads[1] and gqa:
                        continue
                    repeat = heads[0] // heads[1] if not gqa else 1
                    kk, vv = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                                out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=gqa)
                                out.sum().backward()
                            result = "ok"
                        except RuntimeError as e:
                            result = "ERR " + str(e)[:200]
                    print(json.dumps({"seq": seq, "mask": kind, "heads": heads, "gqa": gqa, "backend": "efficient",
                                      "result": result, "why": [str(w.message)[:300] for w in caught][:6]}))


if __name__ == "__main__":
    main()
