"""Build the NF4 store layer by layer: synthetic (seeded random init) or from a local checkpoint.

Peak memory is the store plus about one bf16 decoder layer: each layer is materialised on the
build device, its linears quantized to NF4 straight into the host arena, then freed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from poros.errors import CheckpointError, ConfigError, UnknownModelError
from poros.store import NF4_BLOCKSIZE, NF4Store, absmax_view, host_buffer, plan_layout, weight_view

LAYER_SEED_STRIDE = 1_000_003


def _quantize(w: torch.Tensor):
    import bitsandbytes.functional as bnbf

    return bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=False, quant_type="nf4")


def skeleton(config) -> nn.Module:
    """The causal-LM module tree on the meta device (buffers such as rotary tables stay real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the decoder layer list (`model.layers` for every HF decoder-only family).

    Raises:
        CheckpointError: the architecture keeps its layers in no ModuleList.
    """
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        arch = type(model).__name__
        raise CheckpointError(f"{arch}: no decoder layer list (nn.ModuleList named layers/h/blocks) found")
    return best


def layer_linears(layer: nn.Module, prefix: str) -> list[tuple[str, tuple[int, int]]]:
    return [
        (f"{prefix}.{name}", (m.out_features, m.in_features))
        for name, m in layer.named_modules()
        if isinstance(m, nn.Linear)
    ]


def check_seq_len(config, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        raise ConfigError([f"seq_len: {seq_len} exceeds the model's max_position_embeddings ({limit})"])


# --- sources ---------------------------------------------------------------------------------


@dataclass
class Source:
    """Where the weights come from: a registered synthetic shape or a local checkpoint folder."""

    name: str
    config: object
    checkpoint: Path | None = None

    @property
    def arch(self) -> str:
        return self.config.model_type


def resolve(model: str) -> Source:
    """Turn a registry name or checkpoint folder into a Source.

    Raises:
        UnknownModelError: neither a registered name nor an existing folder.
        CheckpointError: a folder without config.json or without its weights.
    """
    from poros.registry import SHAPES, get_shape

    path = Path(model).expanduser()
    if model in SHAPES:
        return Source(model, get_shape(model).config())
    if path.is_dir():
        return Source(str(path), _checkpoint_config(path), checkpoint=path)
    if os.sep in model or model.startswith("."):
        raise CheckpointError(f"checkpoint folder {model!r} does not exist")
    get_shape(model)  # raises UnknownModelError listing the known names
    raise UnknownModelError(model)  # pragma: no cover


def _checkpoint_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json (expected a Hugging Face checkpoint folder)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}/config.json: {str(e).splitlines()[0]}") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    config.use_cache = False
    return config


class CheckpointReader:
    """Reads one tensor at a time from a (sharded or single) safetensors checkpoint."""

    _PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors weights found")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{path}: shard {shard} named in model.safetensors.index.json is missing")
        self._by_suffix = {self._strip(k): (k, shard) for k, shard in weight_map.items()}
        self._open = {}

    @classmethod
    def _strip(cls, key: str) -> str:
        for p in cls._PREFIXES:
            if p and key.startswith(p):
                return key[len(p) :]
        return key

    def has(self, name: str) -> bool:
        return self._strip(name) in self._by_suffix

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        hit = self._by_suffix.get(self._strip(name))
        if hit is None:
            raise CheckpointError(f"{self.path}: tensor {name} not found in the checkpoint")
        key, shard = hit
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._open[shard].get_tensor(key)


# --- the build -------------------------------------------------------------------------------


@dataclass
class BuildStats:
    seconds: float
    store_bytes: int
    layers: int
    device: str
    peak_device_bytes: int | None


def persistent_buffers(module: nn.Module):
    """(name, buffer) for the buffers a state dict (and so a checkpoint) carries, e.g. gemma4's
    per-layer `layer_scalar`; non-persistent ones (rotary tables) are derived from the config."""
    for mname, m in module.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                yield (f"{mname}.{n}" if mname else n), b


def _fill(module: nn.Module, model: nn.Module, prefix: str, device, seed: int | None, reader) -> None:
    """Materialise `module`'s own parameters on `device`: seeded init or read from the checkpoint.
    Persistent buffers keep their constructed values unless the checkpoint has them."""
    defaults = {n: b.detach().clone() for n, b in persistent_buffers(module)}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in persistent_buffers(module):
            b.copy_(defaults[n])
        if reader is None:
            with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
                torch.manual_seed(seed)
                module.apply(model._init_weights)
        else:
            for name, p in module.named_parameters():
                p.copy_(reader.get(f"{prefix}.{name}" if prefix else name).to(p.dtype))
            for name, b in persistent_buffers(module):
                full = f"{prefix}.{name}" if prefix else name
                if reader.has(full):
                    b.copy_(reader.get(full).to(b.dtype))


def build_store(
    source: Source | str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    on_layer: Callable[[int, int], None] | None = None,
) -> tuple[NF4Store, BuildStats]:
    """Build the NF4 store of `source` layer by layer on `device`.

    Returns:
        The host-resident store and the build's time and peak device memory.
    """
    src = resolve(source) if isinstance(source, str) else source
    if src.checkpoint is not None:
        from poros.nf4_checkpoint import is_bnb_checkpoint, load_nf4_store

        if is_bnb_checkpoint(src.checkpoint):  # already quantized: read, do not build
            return load_nf4_store(src, device=device, progress=progress, on_layer=on_layer)
    device = torch.device(device)
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reader = CheckpointReader(src.checkpoint) if src.checkpoint else None
    model = skeleton(src.config)
    list_name, layers = decoder_layers(model)
    prefixes = [f"{list_name}.{i}" for i in range(len(layers))]
    layouts, total = plan_layout([layer_linears(layer, p) for layer, p in zip(layers, prefixes)])
    arena = host_buffer(total)
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    code = None
    show = sys.stderr.isatty() if progress is None else progress
    for i, (layer, prefix, layout) in enumerate(zip(layers, prefixes, layouts)):
        _fill(layer, model, prefix, device, seed * LAYER_SEED_STRIDE + i, reader)
        linears = dict(layer.named_modules())
        for slot in layout.slots:
            w = linears[slot.name[len(prefix) + 1 :]].weight.detach()
            packed, state = _quantize(w.to(torch.bfloat16))
            weight_view(arena, slot).copy_(packed.reshape(-1, 1))
            absmax_view(arena, slot).copy_(state.absmax.float())
            code = state.code if code is None else code
        for name, p in layer.named_parameters():
            if not (name.endswith(".weight") and isinstance(linears[name.rsplit(".", 1)[0]], nn.Linear)):
                dense[f"{prefix}.{name}"] = p.detach().to("cpu", copy=True)
        for name, b in persistent_buffers(layer):
            buffers[f"{prefix}.{name}"] = b.detach().to("cpu", copy=True)
        layer.to("meta")
        if on_layer:
            on_layer(i + 1, len(layers))
        if show:
            print(f"\rbuilding {src.name}: layer {i + 1}/{len(layers)}", end="", file=sys.stderr, flush=True)
    if show:
        print(file=sys.stderr)
    in_layers = {id(p) for p in layers.parameters()}
    tied = getattr(src.config, "tie_word_embeddings", False)
    for k, (mname, module) in enumerate(model.named_modules()):
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in in_layers]
        own = [(n, p) for n, p in own if p.is_meta and not (tied and f"{mname}.{n}" == "lm_head.weight")]
        if not own:
            continue
        module.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if reader is None:
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seed * LAYER_SEED_STRIDE - 1 - k)  # apart from every layer's seed
                    model._init_weights(module)
            else:
                for n, p in module.named_parameters(recurse=False):
                    p.copy_(reader.get(f"{mname}.{n}").to(p.dtype))
        for n, p in module.named_parameters(recurse=False):
            dense[f"{mname}.{n}" if mname else n] = p.detach().to("cpu", copy=True)
        module.to("meta")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    store = NF4Store(src.config, layouts, arena, dense, code.to("cpu"), source=src.name, buffers=buffers)
    return store, BuildStats(time.perf_counter() - t0, total, len(layers), str(device), peak)

