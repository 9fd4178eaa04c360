"""Where weights come from: a registered synthetic shape or a local Hugging Face checkpoint folder,
read one tensor at a time."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from poros.errors import CheckpointError, UnknownModelError
from poros.models.shapes import SHAPES, get_shape
from poros.paths import unreadable

if TYPE_CHECKING:  # reading a tensor imports it: resolving a model by name loads no torch
    import torch


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

    path = Path(model).expanduser()
    if model in SHAPES:
        return Source(model, get_shape(model).config())
    why = unreadable(path)
    if why:
        raise CheckpointError(f"checkpoint folder {model!r} {why}; pass the checkpoint folder")
    if path.is_dir():
        return Source(str(path), _checkpoint_config(path), checkpoint=path)
    if path.exists():
        raise CheckpointError(f"model {model!r} is a file; expected a checkpoint folder (config.json, safetensors, "
                              f"tokenizer) or a registered name: {', '.join(SHAPES)}")
    if os.sep in model or model.startswith("."):
        raise CheckpointError(f"checkpoint folder {model!r} does not exist")
    get_shape(model)  # raises UnknownModelError listing the known names
    raise UnknownModelError(model)  # pragma: no cover


def cut_source(model: str, layers: int) -> Source:
    """The registered shape `model` cut to its first `layers` decoder layers (`ModelShape.cut`), named
    `MODEL-Nl`: a model whose steps measure one layer's memory or time.

    Raises:
        UnknownModelError: `model` is not a registered shape.
        ValueError: `layers` is not between 1 and the shape's number of layers.
    """
    return Source(f"{model}-{layers}l", get_shape(model).cut(layers))


# fields of config.json that Poros sizes a model with, and the JSON types each must have
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta", "layer_norm_eps")


def config_type_problems(raw: dict) -> list[str]:
    """Fields of a config.json (and of its text_config) whose JSON type is not what a model is sized with."""
    problems = []
    for prefix, d in (("", raw), ("text_config.", raw.get("text_config"))):
        if not isinstance(d, dict):
            continue
        for k, v in d.items():
            want = "an integer" if k in INT_FIELDS else "a number" if k in NUMBER_FIELDS else None
            if want is None or v is None:
                continue
            ok = isinstance(v, int) if k in INT_FIELDS else isinstance(v, (int, float))
            if not ok or isinstance(v, bool):
                problems.append(f"{prefix}{k} is {json.dumps(v)[:40]} ({type(v).__name__}), expected {want}")
            elif k in INT_FIELDS and k not in ("num_hidden_layers", "sliding_window") and v <= 0:  # (no layer: below)
                problems.append(f"{prefix}{k} is {v}, expected an integer > 0")
    return problems


def _checkpoint_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json (expected a Hugging Face checkpoint folder)")
    try:
        raw = json.loads((path / "config.json").read_bytes())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}/config.json: not readable JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}/config.json: expected a JSON object, got {type(raw).__name__}")
    problems = config_type_problems(raw)
    if problems:
        raise CheckpointError(f"{path}/config.json: {'; '.join(problems)}; correct config.json (numbers without "
                              f"quotes)")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise CheckpointError(f"{path}/config.json: {str(e).splitlines()[0]}") from None
    except Exception as e:  # huggingface_hub's strict dataclass validation (transformers 5): a field, or
        # the class's own checks (num_hidden_layers against layer_types)
        if not type(e).__name__.startswith("StrictDataclass"):
            raise
        text = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise CheckpointError(f"{path}/config.json: {text[:240]}; correct config.json") from None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    config.use_cache = False
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 1:
        raise CheckpointError(f"{path}/config.json: num_hidden_layers is {layers}; a model to fine-tune has at least "
                              "one decoder layer: correct config.json")
    _check_layer_count(path, layers)
    return config


LAYER_KEY = re.compile(r"layers\.(\d+)\.")


def _check_layer_count(path: Path, layers: int | None) -> None:
    """Weights of decoder layers config.json does not name would be left out without a word: refused.
    (A folder of config.json alone, or with weights that do not open, is left to what reads them.)

    Raises:
        CheckpointError: naming both counts.
    """
    if not isinstance(layers, int) or not any(path.glob("*.safetensors")):
        return
    try:
        names = CheckpointReader(path).names()
    except CheckpointError:
        return
    found = [int(m.group(1)) for m in map(LAYER_KEY.match, names) if m]
    if found and max(found) >= layers:
        raise CheckpointError(f"{path}/config.json: num_hidden_layers is {layers}, but the weights hold decoder layer "
                              f"{max(found)} ({max(found) + 1} layers); correct num_hidden_layers, or use the "
                              "config.json saved with these weights")


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

    def check_readable(self) -> None:
        """Every weight file opens (its header is whole): a truncated or corrupt file is named before any work.

        Raises:
            CheckpointError: naming the first file that does not open.
        """
        for shard in sorted({shard for _, shard in self._by_suffix.values()}):
            self._handle(shard)

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

    def names(self) -> list[str]:
        """Every tensor's name, its model prefix (`model.`, `language_model.`, ...) removed."""
        return list(self._by_suffix)

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
            import torch

            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise CheckpointError(f"{where}: tensor {key} holds {bad} NaN/inf values of {t.numel()}; the "
                                      f"file is corrupt: download or save it again")
        return t
