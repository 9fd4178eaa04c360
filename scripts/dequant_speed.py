"""NF4 dequantization on the GPU: bitsandbytes' kernel against inductor's (poros/engine/model/dequant_lowering.py), per
projection shape of a model (a probe, not a test).

    python3 scripts/dequant_speed.py qwen2.5-72b [--double-quant] [--repeats 50]

Per shape one JSON line: microseconds per dequantization for each (CUDA events, median of the repeats after a
warm-up), the effective bandwidth (packed bytes read plus bf16 bytes written), and whether the two gave the
same bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def projection_shapes(model: str) -> list[tuple[int, int]]:
    """The distinct [out, in] shapes of one decoder layer's linears."""
    from poros.models.shapes import get_shape
    from poros.models.skeleton import decoder_layers, skeleton

    _, layers = decoder_layers(skeleton(get_shape(model).config()))
    return sorted({(m.out_features, m.in_features) for m in layers[0].modules() if isinstance(m, torch.nn.Linear)})


def time_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    import bitsandbytes.functional as F

    from poros.engine.model.dequant_lowering import install_dequantize_lowerings

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--double-quant", action="store_true")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    install_dequantize_lowerings()
    for shape in projection_shapes(args.model):
        w = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")
        packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=args.double_quant, quant_type="nf4")
        compiled = torch.compile(lambda p: F.dequantize_4bit(p, state), fullgraph=True, dynamic=False)
        same = torch.equal(compiled(packed), F.dequantize_4bit(packed, state))
        bnb_us = time_us(lambda: F.dequantize_4bit(packed, state), args.repeats)
        inductor_us = time_us(lambda: compiled(packed), args.repeats)
        gb = (packed.numel() + 2 * w.numel()) / 1e9
        print(json.dumps({"model": args.model, "shape": list(shape), "double_quant": args.double_quant,
                          "bitsandbytes_us": round(bnb_us, 1), "inductor_us": round(inductor_us, 1),
                          "bitsandbytes_gb_s": round(gb / bnb_us * 1e6), "inductor_gb_s": round(gb / inductor_us * 1e6),
                          "same_bytes": same}), flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
