"""Do regionally compiled NF4 + LoRA decoder layers compute resident's bits under poros's schedule?

    python3 experiments/h200-compile-probe/probe_compile.py --out a.pt [--layers 4] [--seq-len 512] [--variants ...]
    python3 experiments/h200-compile-probe/probe_compile.py --compare a.pt b.pt

Builds a Qwen2.5-72B-shaped model cut to `--layers` decoder layers, then runs one forward and backward of
one synthetic batch per variant and saves the loss and every LoRA gradient (and the step time of two more
calls, and the device memory each call held beyond the model's). A variant is a schedule and whether each decoder layer is `layer.compile()`d:
  plain     resident QLoRA: the model's own forward with autograd;
  nograd    poros's schedule today: the layer's forward without autograd, its input kept, the forward
            recomputed with autograd in backward;
  grad      the same, but the first forward runs with autograd too (the training graph) and drops it.
Compiled variants take the name with `compiled-`. Run it twice, in two processes, and `--compare` the files:
equal bits across processes and across schedules is what a `compile` setting needs. A GPU probe, not a test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from poros.config import TrainConfig
from poros.engine.model.compiling import compile_module
from poros.engine.methods.trainer import ResidentTrainer, deterministic_kernels, enable_determinism
from poros.models.checkpoint import Source
from poros.models.shapes import get_shape
from poros.store.build import build_store

VARIANTS = ("plain", "nograd", "grad", "compiled-plain", "compiled-nograd", "compiled-grad")


class Recompute(torch.autograd.Function):
    """The layer's forward once without keeping its graph, then recomputed with autograd in backward.
    The layer's LoRA parameters are inputs only so that the output requires grad where the layer's input
    does not (the first layer's, after the frozen embeddings); their gradients accumulate in backward."""

    @staticmethod
    def forward(ctx, x, layer, grad_forward, args, kwargs, *params):
        ctx.layer, ctx.args, ctx.kwargs, ctx.n = layer, args, kwargs, len(params)
        ctx.save_for_backward(x)
        with torch.enable_grad() if grad_forward else torch.no_grad():
            out = layer(x.detach().requires_grad_(grad_forward and x.requires_grad), *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        wants = ctx.needs_input_grad[0]
        x = x.detach().requires_grad_(wants)
        with torch.enable_grad():
            out = ctx.layer(x, *ctx.args, **ctx.kwargs)
            out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward(out, grad)
        return (x.grad if wants else None), None, None, None, None, *([None] * ctx.n)


class Scheduled(nn.Module):
    def __init__(self, layer: nn.Module, grad_forward: bool):
        super().__init__()
        self.layer, self.grad_forward = layer, grad_forward

    def forward(self, hidden_states, *args, **kwargs):
        params = [p for p in self.layer.parameters() if p.requires_grad]
        return Recompute.apply(hidden_states, self.layer, self.grad_forward, args, kwargs, *params)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_variant(trainer: ResidentTrainer, variant: str, batch) -> dict:
    layers = trainer.qlora.layers
    originals = list(layers)
    compiled = variant.startswith("compiled-")
    schedule = variant.removeprefix("compiled-")
    torch._dynamo.reset()
    for i, layer in enumerate(originals):
        if compiled:
            compile_module(layer)
        if schedule != "plain":
            layers[i] = Scheduled(layer, grad_forward=schedule == "grad")
    times, peaks, first = [], [], None
    try:
        for k in range(3):
            trainer.optimizer.zero_grad(set_to_none=True)
            sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            with deterministic_kernels():
                loss = trainer.forward_backward(batch)
            sync()
            times.append(time.perf_counter() - t0)
            if torch.cuda.is_available():  # what the forward and backward held beyond the model: saved tensors
                peaks.append((torch.cuda.max_memory_allocated() - base) / 1e9)
            if k == 0:
                first = {"loss": loss.float().cpu(),
                         "grads": {n: g.detach().cpu().clone() for n, g in trainer.lora_grads().items()}}
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
            if compiled:
                layer._compiled_call_impl = None
    return {**first, "seconds": times, "peak_above_model_gb": peaks}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--compare", nargs="+")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--inductor-deterministic", type=int, default=1)
    p.add_argument("--model", default="qwen2.5-72b")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    enable_determinism()
    torch._inductor.config.deterministic = bool(args.inductor_deterministic)
    config = get_shape(args.model).config()
    config.num_hidden_layers = config.max_window_layers = args.layers
    config.layer_types = ["full_attention"] * args.layers
    store, _ = build_store(Source(f"{args.model}-{args.layers}l", config), device=args.device, progress=False)
    cfg = TrainConfig(model=args.model, device=args.device, attention="fast", deterministic=True, seq_len=args.seq_len)
    trainer = ResidentTrainer(store, cfg)
    batch = trainer.batches(0)[0]
    out = {"meta": {"torch": str(torch.__version__), "seq_len": args.seq_len, "layers": args.layers,
                    "inductor_deterministic": bool(args.inductor_deterministic)}}
    for v in args.variants.split(","):
        t0 = time.perf_counter()
        out[v] = run_variant(trainer, v, batch)
        print(json.dumps({"variant": v, "loss": float(out[v]["loss"]), "seconds": out[v]["seconds"],
                          "peak_above_model_gb": out[v]["peak_above_model_gb"],
                          "wall": round(time.perf_counter() - t0, 1)}), flush=True)
    torch.save(out, args.out)


def compare(paths: list[str]) -> None:
    runs = {}
    for i, path in enumerate(paths):
        data = torch.load(path)
        for v, r in data.items():
            if v != "meta":
                runs[f"{i}:{v}"] = r
    names = list(runs)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            ra, rb = runs[a], runs[b]
            equal = torch.equal(ra["loss"], rb["loss"]) and all(
                torch.equal(ra["grads"][n], rb["grads"][n]) for n in ra["grads"])
            worst = max(float((ra["grads"][n].float() - rb["grads"][n].float()).abs().max()) for n in ra["grads"])
            print(json.dumps({"a": a, "b": b, "equal": equal, "max_abs_grad_diff": worst,
                              "loss": [float(ra["loss"]), float(rb["loss"])]}))


if __name__ == "__main__":
    main()
