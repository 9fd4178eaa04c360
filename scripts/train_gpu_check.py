"""`poros train` end to end on a 32B-shaped checkpoint: tokens/s and peak memory of poros and resident,
whether the loss falls, whether the two adapters are torch.equal, and whether peft loads the adapter.

    python3 scripts/train_gpu_check.py                                   # qwen3-32b, cuda, 100 steps
    python3 scripts/train_gpu_check.py --model tiny-qwen2 --device cpu --steps 20 --seq-len 64 --lr 3e-3

Each stage is skipped when its output is already in --out, so a cut-off check continues where it was:
  1. data.jsonl and eval.jsonl: generated text and arithmetic chats (poros/finetune/samples.py);
  2. model/: the shape built synthetically (seeded) on --device, exported as a bitsandbytes NF4
     checkpoint (poros/store/export.py) with a byte-level BPE tokenizer trained on the data (ids < vocab);
  3. run-poros/, run-resident/: `python -m poros train`, one child process per method (so each has its
     own peak memory); an unfinished run is continued with --resume;
  4. the adapters and AdamW states compared tensor by tensor, then run-poros/adapter loaded into the
     NF4 model with peft: no missing or unexpected keys, the same tensors, and a lower eval loss with
     the adapter than without.
Prints one JSON line per method and a final summary (also OUT/summary.json); exits 0 only if every
check passes. On cuda both runs take poros train's defaults (attention fast under strict determinism,
repeatable; poros also CUDA-graph layers and vram_budget auto) unless flags here say otherwise.

Under a time limit per command, run it in parts with the same --out (each part reuses what is there):
    python3 scripts/train_gpu_check.py --methods '' --skip-peft       # data and the NF4 checkpoint
    python3 scripts/train_gpu_check.py --methods poros --skip-peft
    python3 scripts/train_gpu_check.py --methods resident --skip-peft
    python3 scripts/train_gpu_check.py                                 # compare, load with peft
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from poros.finetune.samples import generated_chats, generated_texts, train_tokenizer, write_jsonl

METHODS = ("poros", "resident")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-32b", help="registered shape (default qwen3-32b)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="out/train-check")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--attention", default=None, help="default: poros train's (fast, deterministic, on cuda)")
    p.add_argument("--cuda-graphs", action="store_true", help="poros: replay layers from CUDA graphs")
    p.add_argument("--vram-budget", metavar="SIZE", help="poros: device memory its plan may use (e.g. 24GB)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms in both runs")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of poros,resident")
    p.add_argument("--skip-peft", action="store_true", help="leave out loading the adapter with peft")
    p.add_argument("--texts", type=int, default=3000, help="generated text records (plus a third as many chats)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE tokenizer size (capped by the model's vocabulary)")
    return p.parse_args(argv)


def say(msg: str) -> None:
    print(f"[train-check] {msg}", file=sys.stderr, flush=True)


def make_data(out: Path, n: int) -> list[str]:
    texts = generated_texts(n, seed=0)
    if not (out / "data.jsonl").is_file():
        write_jsonl(out / "eval.jsonl", [{"text": t} for t in generated_texts(max(8, n // 50), seed=1)])
        write_jsonl(out / "data.jsonl", [{"text": t} for t in texts] +
                    [{"messages": m} for m in generated_chats(n // 3, seed=0)])
        say(f"wrote {out / 'data.jsonl'} ({n} texts, {n // 3} chats) and {out / 'eval.jsonl'}")
    return texts


def make_model(out: Path, args, texts: list[str]) -> Path:
    from poros.store.build import build_store
    from poros.store.export import export_bnb4bit

    folder = out / "model"
    if (folder / "model.safetensors.index.json").is_file() and (folder / "chat_template.jinja").is_file():
        say(f"reusing {folder}")
        return folder
    say(f"building {args.model} on {args.device} and exporting it as NF4 to {folder}")
    store, stats = build_store(args.model, seed=0, device=args.device, progress=True)
    say(f"built in {stats.seconds:.0f} s ({stats.store_bytes / 1e9:.1f} GB NF4)")
    export_bnb4bit(store, folder)
    vocab = store.config.vocab_size
    del store
    gc.collect()
    for f in folder.iterdir():  # export's stand-in word-level tokenizer
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    tok = train_tokenizer(folder, texts, vocab_size=min(args.vocab, vocab))
    say(f"tokenizer: {len(tok)} tokens (model vocabulary {vocab})")
    return folder


def run_method(out: Path, model: Path, method: str, args) -> dict:
    run = out / f"run-{method}"
    if (run / "adapter" / "adapter_model.safetensors").is_file():
        say(f"reusing {run}")
    else:
        cmd = [sys.executable, "-m", "poros", "train", "--model", str(model), "--data", str(out / "data.jsonl"),
               "--eval-data", str(out / "eval.jsonl"), "--out", str(run), "--steps", str(args.steps),
               "--seq-len", str(args.seq_len), "--lr", repr(args.lr), "--block-size", str(args.block_size),
               "--method", method, "--device", args.device, "--save-every", str(max(1, args.steps // 2))]
        if args.attention:  # else poros train's default: on cuda attention fast under strict determinism
            cmd += ["--attention", args.attention]
        if args.cuda_graphs and method == "poros":
            cmd.append("--cuda-graphs")
        if args.vram_budget and method == "poros":
            cmd += ["--vram-budget", args.vram_budget]
        if args.deterministic:
            cmd.append("--deterministic")
        if (run / "checkpoint" / "state.json").is_file():
            cmd.append("--resume")
        say(" ".join(cmd))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # the tokenizer was trained in this process
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"[train-check] poros train --method {method} exited {proc.returncode}")
    with (run / "log.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in rows]
    k = max(1, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    speeds = sorted(float(r["tokens_per_s"]) for r in rows[1:] or rows)  # step 1 carries the warm-up
    evals = [float(r["eval_loss"]) for r in rows if r["eval_loss"]]
    row = {"method": method, "steps": len(rows), "tokens_per_s": round(speeds[len(speeds) // 2], 1),
           "peak_memory_gb": max(float(r["peak_memory_gb"]) for r in rows),
           "loss_first": round(first, 4), "loss_last": round(last, 4), "loss_falls": last < first,
           "eval_loss": evals, "run": str(run)}
    print(json.dumps(row), flush=True)
    return row


def run_state(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {f"adapter:{k}": v for k, v in load_file(str(run / "checkpoint/adapter/adapter_model.safetensors")).items()}
    for i, s in torch.load(run / "checkpoint/optimizer.pt", map_location="cpu", weights_only=True)["state"].items():
        state.update({f"adamw:{i}:{k}": v for k, v in s.items()})
    return state


def first_difference(a: dict, b: dict) -> str | None:
    if sorted(a) != sorted(b):
        return f"names differ: {sorted(set(a) ^ set(b))[:3]}"
    for k in a:
        if not torch.equal(a[k], b[k]):
            diff = (a[k].double() - b[k].double()).abs()
            return f"{k}: max |diff| {diff.max():.3e} at {int((diff > 0).sum())} of {diff.numel()} elements"
    return None


def check_peft(model_dir: Path, adapter: Path, eval_path: Path, device: str, seq_len: int) -> dict:
    """Load the NF4 checkpoint with transformers and the adapter with peft; compare the tensors and
    the eval loss with and without the adapter."""
    import warnings

    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    from poros.finetune.data import load_data
    from poros.finetune.tokenizing import load_tokenizer

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), device_map={"": device},
                                                             dtype=torch.bfloat16, attn_implementation="sdpa")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter))
    missing = [str(w.message) for w in caught if "adapter keys" in str(w.message)]
    result = model.load_adapter(str(adapter), adapter_name="check")
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    live = {n.replace(".default.", "."): p for n, p in model.named_parameters() if ".default." in n}
    same = sorted(saved) == sorted(live) and all(torch.equal(saved[k], live[k].detach().cpu()) for k in saved)
    model.set_adapter("default")
    data = load_data(eval_path, load_tokenizer(model_dir), seq_len, seed=0, vocab_size=base.config.vocab_size)
    batches = data.in_order(1)[:8]

    @torch.no_grad()
    def loss() -> float:
        return sum(float(model(input_ids=b.input_ids.to(device), labels=b.labels.to(device)).loss)
                   for b in batches) / len(batches)

    with_adapter = loss()
    with model.disable_adapter():
        without = loss()
    return {"peft_missing_warnings": missing, "missing_keys": result.missing_keys,
            "unexpected_keys": result.unexpected_keys, "tensors": len(saved), "tensors_equal": same,
            "eval_loss_with_adapter": round(with_adapter, 4), "eval_loss_without": round(without, 4)}


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = make_data(out, args.texts)
    model = make_model(out, args, texts)
    rows = {m: run_method(out, model, m, args) for m in methods}
    summary = {"model": args.model, "device": args.device, "steps": args.steps, "seq_len": args.seq_len,
               "methods": rows, "checks": {}}
    checks = summary["checks"]
    for m, r in rows.items():
        checks[f"{m}_loss_falls"] = r["loss_falls"]
    if set(METHODS) <= set(rows):
        resident = run_state(out / "run-resident")
        diff = first_difference(resident, run_state(out / "run-poros"))
        checks["poros_equals_resident"] = diff is None
        summary["first_difference"] = diff
        nudged = dict(resident)  # negative control: one element one ulp off is reported
        key = next(k for k in nudged if ".lora_B." in k)
        nudged[key] = nudged[key].clone()
        nudged[key].view(-1)[0] = torch.nextafter(nudged[key].view(-1)[0], torch.tensor(1.0))
        checks["comparison_catches_one_ulp"] = first_difference(resident, nudged) is not None
    if rows and not args.skip_peft:
        gc.collect()
        adapter = out / f"run-{'poros' if 'poros' in rows else methods[0]}" / "adapter"
        peft = summary["peft"] = check_peft(model, adapter, out / "eval.jsonl", args.device, args.seq_len)
        checks["peft_loads"] = (not peft["peft_missing_warnings"] and not peft["missing_keys"]
                                and not peft["unexpected_keys"] and peft["tensors_equal"])
        checks["peft_adapter_lowers_eval_loss"] = peft["eval_loss_with_adapter"] < peft["eval_loss_without"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    failed = [k for k, ok in checks.items() if not ok]
    say("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
