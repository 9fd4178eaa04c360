"""The model's module tree from its config alone: the causal-LM skeleton on the meta device, its
decoder layers, their linears, and the checks a model must pass before anything is built."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from poros.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # imported by the functions that build or walk a module tree: checks on a config load no torch
    from torch import nn


@contextlib.contextmanager
def _meta_weights():
    """nn.Linear and nn.Embedding (and their subclasses) made straight on the meta device.
    `init_empty_weights` moves a parameter to meta only once its constructor has allocated it on the
    CPU: for a 72B model some 145 GB of `torch.empty`, seconds of set-up with some transformers versions."""
    from torch import nn

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
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # advice for other uses of a class (BERT's `is_decoder`) is not Poros's to print
    try:
        with init_empty_weights(include_buffers=False), _meta_weights():
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    except ValueError as e:
        import transformers

        raise CheckpointError(f"model_type {getattr(config, 'model_type', '?')!r}: no causal-LM model in transformers "
                              f"{transformers.__version__} ({str(e).splitlines()[0][:160]}); Poros trains decoder-only "
                              f"causal LMs such as qwen2, qwen3, gemma3, gemma4") from None
    finally:
        hf_logging.set_verbosity(level)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Find the decoder layer list (`model.layers` for every HF decoder-only family).

    Raises:
        CheckpointError: the architecture keeps its layers in no ModuleList.
    """
    from torch import nn

    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks"):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    if best is None:
        arch = type(model).__name__
        raise CheckpointError(f"{arch}: no decoder layer list (nn.ModuleList named layers/h/blocks) found; Poros "
                              "trains decoder-only causal LMs such as qwen2, qwen3, gemma3, gemma4")
    return best


def check_supported(name: str, layers: nn.ModuleList, list_name: str) -> None:
    """Every weight matrix of a decoder layer must sit in an nn.Linear: Poros quantizes those to NF4
    and streams them; any other module holding one (GPT-2's Conv1D, for one) it cannot.

    Raises:
        CheckpointError: naming the first such module and its type.
    """
    from torch import nn

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
    from torch import nn

    return [
        (f"{prefix}.{name}", (m.out_features, m.in_features))
        for name, m in layer.named_modules()
        if isinstance(m, nn.Linear)
    ]


def smallest_adapted(config, targets) -> tuple[int, str] | None:
    """The smallest dimension (in or out features) of a decoder linear named in `targets`, and that linear's name
    (None where no linear is named): LoRA's rank beyond it adds no expressive power, only memory."""
    list_name, layers = decoder_layers(skeleton(config))
    widths = [(min(shape), name) for i, layer in enumerate(layers) for name, shape in layer_linears(layer, f"{list_name}.{i}")
              if name.rsplit(".", 1)[-1] in set(targets)]
    return min(widths) if widths else None


def check_lora_rank(config, rank: int, targets, name: str = "the model") -> None:
    """Raises: ConfigError when `rank` exceeds the smallest dimension of an adapted linear, naming both."""
    found = smallest_adapted(config, targets)
    if found is not None and rank > found[0]:
        owner = f"{name}'s"
        raise ConfigError([f"lora_rank: {rank} exceeds {owner} smallest adapted dimension, {found[0]} ({found[1]}); "
                           f"use lora_rank <= {found[0]}"])


def check_seq_len(config, seq_len: int, name: str = "the model") -> None:
    """Raises: ConfigError when `seq_len` exceeds the model's max_position_embeddings."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        owner = name if name == "the model" else f"{name}'s"
        raise ConfigError([f"seq_len: {seq_len} exceeds {owner} max_position_embeddings ({limit}); "
                           f"use seq_len <= {limit}"])


def persistent_buffers(module: nn.Module):
    """(name, buffer) for the buffers a state dict (and so a checkpoint) carries, e.g. gemma4's
    per-layer `layer_scalar`; non-persistent ones (rotary tables) are derived from the config."""
    for mname, m in module.named_modules():
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                yield (f"{mname}.{n}" if mname else n), b
