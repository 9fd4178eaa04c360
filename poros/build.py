"""Build the NF4 store layer by layer: synthetic (seeded random init) or from a local checkpoint.

Peak memory is the store plus about one bf16 decoder layer: each layer is materialised on the
build device, its linears quantized to NF4 straight into the host arena, then freed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from poros.errors import CheckpointError, ConfigError, PorosError, UnknownModelError
from poros.store import NF4_BLOCKSIZE, NF4Store, absmax_view, host_buffer, plan_layout, weight_view

LAYER_SEED_STRIDE = 1_000_003


def _quantize(w: torch.Tensor):
    import bitsandbytes.functional as bnbf

    return bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=False, quant_type="nf4")


@contextlib.contextmanager
def _meta_weights():
    """nn.Linear and nn.Embedding (and their subclasses) made straight on the meta device.
    `init_empty_weights` moves a parameter to meta only once its constructor has allocated it on the
    CPU: for a 72B model some 145 GB of `torch.empty`, seconds of set-up with some transformers versions."""
    originals = {cls: cls.__init__ for cls in (nn.Linear, nn.Embedding)}

    def on_meta(init):
        def made_on_meta(self, *args, **kwargs):
            kwargs.setdefault("device", "meta")
            init(self, *args, **kwargs)
        return made_on_meta

    for cls, init in originals.items():
        cls.__init__ = on_meta(init)
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def skeleton(config) -> nn.Module:
    """The causal-LM module tree on the meta device (buffers such as rotary tables stay real).

    Raises:
        CheckpointError: transformers has no causal-LM class for the config's model_type.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False), _meta_weights():
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    except ValueError as e:
        import transformers

        raise CheckpointError(f"model_type {getattr(config, 'model_type', '?')!r}: no causal-LM model in transformers "
                              f"{transformers.__version__} ({str(e).splitlines()[0][:160]}); Poros trains decoder-only "
                              f"causal LMs such as qwen2, qwen3, gemma3, gemma4") from None


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


def check_supported(name: str, layers: nn.ModuleList, list_name: str) -> None:
    """Every weight matrix of a decoder layer must sit in an nn.Linear: Poros quantizes those to NF4
    and streams them; any other module holding one (GPT-2's Conv1D, for one) it cannot.

    Raises:
        CheckpointError: naming the first such module and its type.
    """
    for i, layer in enumerate(layers):
        for mname, m in layer.named_modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                continue
            own = [n for n, p in m.named_parameters(recurse=False) if p.dim() >= 2]
            if own:
                raise CheckpointError(
                    f"{name}: {list_name}.{i}.{mname}.{own[0]} belongs to a {type(m).__name__}, which Poros cannot "
                    f"quantize (it streams the nn.Linear layers of each decoder layer as NF4); supported are "
                    f"decoder-only families built from nn.Linear, e.g. qwen2, qwen3, gemma3, gemma4")


def layer_linears(layer: nn.Module, prefix: str) -> list[tuple[str, tuple[int, int]]]:
    return [
        (f"{prefix}.{name}", (m.out_features, m.in_features))
        for name, m in layer.named_modules()
        if isinstance(m, nn.Linear)
    ]


def check_seq_len(config, seq_len: int, name: str = "the model") -> None:
    """Raises: ConfigError when `seq_len` exceeds the model's max_position_embeddings."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        owner = name if name == "the model" else f"{name}'s"
        raise ConfigError([f"seq_len: {seq_len} exceeds {owner} max_position_embeddings ({limit}); "
                           f"use seq_len <= {limit}"])


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
        self.path = path
        self._open = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
            except (ValueError, KeyError, TypeError, AssertionError):
                raise CheckpointError(f"{index}: not a safetensors index (JSON with a weight_map of tensor name to "
                                      f"file); re-save the checkpoint or delete the index") from None
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors weights found")
            weight_map = {}
            for f in files:
                weight_map.update({k: f.name for k in self._handle(f.name).keys()})
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise CheckpointError(f"{path}: shard {shard} named in model.safetensors.index.json is missing")
        self._by_suffix = {self._strip(k): (k, shard) for k, shard in weight_map.items()}

    def _handle(self, shard: str):
        from safetensors import safe_open

        if shard not in self._open:
            try:
                self._open[shard] = safe_open(str(self.path / shard), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a bad header
                raise CheckpointError(f"{self.path / shard}: not a readable safetensors file "
                                      f"({str(e).splitlines()[0][:160]}); it is truncated or corrupt: "
                                      f"download or save it again") from None
        return self._open[shard]

    @classmethod
    def _strip(cls, key: str) -> str:
        for p in cls._PREFIXES:
            if p and key.startswith(p):
                return key[len(p) :]
        return key

    def has(self, name: str) -> bool:
        return self._strip(name) in self._by_suffix

    def get(self, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`; with `like`, checked to have its shape and a floating-point dtype
        (copy_ would broadcast a [1] tensor over a [128] norm weight without a word).

        Raises:
            CheckpointError: naming the file and tensor that is missing, unreadable or mis-shaped.
        """
        hit = self._by_suffix.get(self._strip(name))
        if hit is None:
            raise CheckpointError(f"{self.path}: tensor {name} not found in the checkpoint")
        key, shard = hit
        where = self.path / shard
        try:
            t = self._handle(shard).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where}: tensor {key} cannot be read ({str(e).splitlines()[0][:160]}); the "
                                  f"file is truncated or corrupt: download or save it again") from None
        if like is not None:
            if tuple(t.shape) != tuple(like.shape):
                raise CheckpointError(f"{where}: tensor {key} has shape {list(t.shape)}, expected {list(like.shape)} "
                                      f"from config.json; the weights do not match their config.json")
            if like.is_floating_point() and not t.is_floating_point():
                raise CheckpointError(f"{where}: tensor {key} is {t.dtype}, expected floating-point weights (a "
                                      f"quantized checkpoint?); pass the original bf16/fp16/fp32 checkpoint")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise CheckpointError(f"{where}: tensor {key} holds {bad} NaN/inf values of {t.numel()}; the "
                                      f"file is corrupt: download or save it again")
        return t


# --- host memory -----------------------------------------------------------------------------

SKIP_MEMORY_CHECK = "POROS_SKIP_MEMORY_CHECK"
QUANTIZE_PEAK = 7  # host bytes bitsandbytes' CPU quantize_4bit holds per byte of its bf16 input
# room left beyond the estimate: MemAvailable is itself an estimate, and allocator slack, the page
# cache of a checkpoint being read and other processes all take some; a build that would leave
# less than this is refused rather than run to the edge of the host's memory
MEMORY_HEADROOM = 0.10


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class HostNeed:
    """Host memory a build takes, from the model's shapes alone."""

    arena: int  # the NF4 decoder weights with their absmax
    dense: int  # every other weight (embeddings, lm_head, norms, biases) and the layers' persistent buffers
    transient: int  # held only during a CPU build: one bf16 layer and its quantization, or a dense weight's copy

    @property
    def store(self) -> int:
        return self.arena + self.dense

    @property
    def total(self) -> int:
        return self.arena + self.dense + self.transient


def host_need(model: nn.Module, layers: nn.ModuleList, arena_bytes: int, device) -> HostNeed:
    in_layers = {id(p) for p in layers.parameters()}
    tied = getattr(model.config, "tie_word_embeddings", False)  # the build keeps one copy (embed_tokens)
    outside = [p for n, p in model.named_parameters() if id(p) not in in_layers and not (tied and n == "lm_head.weight")]
    layer_dense = [p for layer in layers for n, p in layer.named_parameters()
                   if not (n.endswith(".weight") and isinstance(layer.get_submodule(n.rsplit(".", 1)[0]), nn.Linear))]
    buffers = [b for layer in layers for _, b in persistent_buffers(layer)]
    transient = 0
    if torch.device(device).type == "cpu":
        # one bf16 layer, plus bitsandbytes' CPU quantize_4bit, which peaks at about 7x its bf16 input
        # (measured with bitsandbytes 0.50: +1.83 GB for a 5120x25600 matrix); or a dense weight's copy
        linears = [m.weight for layer in layers for m in layer.modules() if isinstance(m, nn.Linear)]
        biggest_layer = max((_nbytes(layer.parameters()) for layer in layers), default=0)
        quantize = QUANTIZE_PEAK * max((_nbytes([w]) for w in linears), default=0)
        transient = max(biggest_layer + quantize, max((_nbytes([p]) for p in outside), default=0))
    return HostNeed(arena_bytes, _nbytes(outside) + _nbytes(layer_dense) + _nbytes(buffers), transient)


def config_host_need(config, device) -> HostNeed:
    """What building `config` on `device` takes in host memory, from its shapes alone."""
    model = skeleton(config)
    list_name, layers = decoder_layers(model)
    _, total = plan_layout([layer_linears(layer, f"{list_name}.{i}") for i, layer in enumerate(layers)])
    return host_need(model, layers, total, device)


def store_bytes(config) -> int:
    """Host bytes of the NF4 store of `config` (arena, dense weights, buffers), from its shapes alone."""
    return config_host_need(config, "meta").store


def available_host_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup memory limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap, used = Path(limit).read_text().strip(), Path(usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:
            found.append(max(0, int(cap) - int(used)))
    return min(found) if found else None


def check_host_memory(name: str, need: HostNeed, available: int | None = None) -> None:
    """Refuse a build that would not fit in host memory, before anything is allocated.

    Raises:
        PorosError: naming what the build needs, what is available and what to do.
    """
    available = available_host_memory() if available is None else available
    wanted = int(need.total * (1 + MEMORY_HEADROOM))
    if available is None or os.environ.get(SKIP_MEMORY_CHECK) == "1" or wanted <= available:
        return
    parts = f"NF4 store {need.arena / 1e9:.1f} GB + bf16 embeddings and norms {need.dense / 1e9:.1f} GB"
    if need.transient:
        parts += f" + {need.transient / 1e9:.1f} GB while a layer is built on the CPU"
    raise PorosError(f"building {name} needs about {need.total / 1e9:.1f} GB of host memory ({parts}), "
                     f"{wanted / 1e9:.1f} GB with {MEMORY_HEADROOM:.0%} headroom; {available / 1e9:.1f} GB is "
                     f"available: free memory or use a larger machine ({SKIP_MEMORY_CHECK}=1 tries anyway)")


class LayerProgress:
    """`\rWHAT: layer i/n` on stderr (a terminal by default) and `on_layer(i, n)`, layer by layer."""

    def __init__(self, what: str, n: int, show: bool | None, on_layer: Callable[[int, int], None] | None = None):
        self.what, self.n, self.on_layer = what, n, on_layer
        self.show = sys.stderr.isatty() if show is None else show

    def __call__(self, i: int) -> None:
        if self.on_layer:
            self.on_layer(i, self.n)
        if self.show:
            print(f"\r{self.what}: layer {i}/{self.n}", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.show:
            print(file=sys.stderr)


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
                p.copy_(reader.get(f"{prefix}.{name}" if prefix else name, like=p).to(p.dtype))
            for name, b in persistent_buffers(module):
                full = f"{prefix}.{name}" if prefix else name
                if reader.has(full):
                    b.copy_(reader.get(full, like=b).to(b.dtype))


def build_store(
    source: Source | str,
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    allocate: Callable[[int], torch.Tensor] | None = None,
) -> tuple[NF4Store, BuildStats]:
    """Build the NF4 store of `source` layer by layer on `device`.

    `allocate(nbytes)` gives the zeroed host bytes of the arena (by default private memory;
    `poros.distributed` passes memory the ranks of a host share).

    Returns:
        The host-resident store and the build's time and peak device memory.
    """
    src = resolve(source) if isinstance(source, str) else source
    if src.checkpoint is not None:
        from poros.nf4_checkpoint import is_bnb_checkpoint, load_nf4_store

        if is_bnb_checkpoint(src.checkpoint):  # already quantized: read, do not build
            return load_nf4_store(src, device=device, progress=progress, on_layer=on_layer, allocate=allocate)
    device = torch.device(device)
    t0 = time.perf_counter()
    model = skeleton(src.config)
    try:
        list_name, layers = decoder_layers(model)
    except CheckpointError as e:
        raise CheckpointError(f"{src.name}: {e}") from None
    check_supported(src.name, layers, list_name)
    prefixes = [f"{list_name}.{i}" for i in range(len(layers))]
    layouts, total = plan_layout([layer_linears(layer, p) for layer, p in zip(layers, prefixes)])
    check_host_memory(src.name, host_need(model, layers, total, device))
    reader = CheckpointReader(src.checkpoint) if src.checkpoint else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    arena = (allocate or host_buffer)(total)
    dense: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    code = None
    report = LayerProgress(f"building {src.name}", len(layers), progress, on_layer)
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
        report(i + 1)
    report.done()
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
                    p.copy_(reader.get(f"{mname}.{n}", like=p).to(p.dtype))
        for n, p in module.named_parameters(recurse=False):
            dense[f"{mname}.{n}" if mname else n] = p.detach().to("cpu", copy=True)
        module.to("meta")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    store = NF4Store(src.config, layouts, arena, dense, code.to("cpu"), source=src.name, buffers=buffers)
    return store, BuildStats(time.perf_counter() - t0, total, len(layers), str(device), peak)

