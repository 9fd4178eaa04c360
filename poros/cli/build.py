"""`poros build`: build a model's NF4 store layer by layer and report time and peak memory.

A build that would not fit in host memory (estimated from the model's shapes) is refused before
anything is allocated."""

from __future__ import annotations

import json

from poros.errors import ConfigError
from poros.models.shapes import SHAPES, count_params
from poros.store.host_memory import config_host_need

EPILOG = """examples:
  poros build --list
  poros build --model tiny-gemma3
  poros build --model qwen2.5-72b --device cuda
  poros build --model ./my-checkpoint --device cuda
"""


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build (synthetic or from a checkpoint) and quantize a model", epilog=EPILOG)
    p.add_argument("--model", help="registered name or checkpoint folder")
    p.add_argument("--device", default=None, help="device the layers are built and quantized on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the registered model shapes")
    p.set_defaults(run=run)


def run(args) -> int:
    import resource

    import torch

    from poros.store.build import build_store

    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name:14s} {shape.arch:8s} {count_params(shape.config()) / 1e9:8.3f}B params")
        return 0
    if not args.model:
        raise ConfigError(["--model is required (or --list)"], "poros build")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    store, stats = build_store(args.model, seed=args.seed, device=device, progress=None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "model": args.model,
        "layers": stats.layers,
        "nf4_store_gb": round(stats.store_bytes / 1e9, 3),
        "layer_gb": round(store.layers[0].nbytes / 1e9, 4),
        "dense_gb": round(sum(t.numel() * t.element_size() for t in store.dense.values()) / 1e9, 3),
        "seconds": round(stats.seconds, 2),
        "device": stats.device,
        "peak_device_gb": None if stats.peak_device_bytes is None else round(stats.peak_device_bytes / 1e9, 3),
        "peak_host_rss_gb": round(rss / 1e9, 3),
        # what the up-front memory check assumed the build adds to the process (shapes alone)
        "host_estimate_gb": round(config_host_need(store.config, device).total / 1e9, 3),
    }))
    return 0
