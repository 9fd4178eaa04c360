"""Instantiate a trainable QLoRA model from an NF4 store: bnb Linear4bit layers + peft LoRA."""

from __future__ import annotations

import math

import torch
from torch import nn

from poros.config import LoRACompute, TrainConfig
from poros.engine.model.dropout import DropoutKeys, key_lora_dropout
from poros.engine.model.head import use_chunked_loss
from poros.engine.model.lora_compute import lora_in_activation_dtype
from poros.engine.model.attention_chunk import use_chunked_attention
from poros.engine.model.mlp_chunk import use_chunked_mlp
from poros.errors import ConfigError
from poros.models.skeleton import decoder_layers, skeleton
from poros.store.arena import NF4Store, SlotTensors, slot_tensors
from poros.store.layout import NF4_BLOCKSIZE, QuantSlot
from poros.store.quantize import quant_state


def _set_param(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _to_linear4bit(list_name: str, layers: nn.ModuleList, double_quant: bool) -> dict[str, nn.Module]:
    """Swap every nn.Linear inside the decoder layers for a (still empty) bnb Linear4bit."""
    import bitsandbytes as bnb

    swapped = {}
    for i, layer in enumerate(layers):
        for name, m in list(layer.named_modules()):
            if not isinstance(m, nn.Linear):
                continue
            q = bnb.nn.Linear4bit(
                m.in_features,
                m.out_features,
                bias=m.bias is not None,
                compute_dtype=torch.bfloat16,
                quant_type="nf4",
                compress_statistics=double_quant,
                device="meta",
            )
            owner, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(owner) if owner else layer, leaf, q)
            swapped[f"{list_name}.{i}.{name}"] = q
    return swapped


def bind_nf4(module: nn.Module, tensors: SlotTensors, code: torch.Tensor, nested_code: torch.Tensor | None,
             shape) -> None:
    """Point a Linear4bit at one NF4 matrix's tensors (private copies for resident, views of a block buffer for
    poros), with the QuantState bitsandbytes gives such a linear (double-quantized: its nested state)."""
    import bitsandbytes as bnb

    state = quant_state(tensors, code, nested_code, shape)
    module.weight = bnb.nn.Params4bit(
        tensors.weight,
        requires_grad=False,
        quant_state=state,
        blocksize=NF4_BLOCKSIZE,
        compress_statistics=state.nested,
        quant_type="nf4",
        module=module,
        bnb_quantized=True,
    )
    module.quant_state = state


def io_param_names(model: nn.Module) -> set[str]:
    """Parameter names of the input embeddings and the lm_head (tied or not)."""
    ids = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
           for p in m.parameters(recurse=False)}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


class QLoRAModel:
    """A peft-wrapped causal LM whose decoder linears are NF4 Linear4bit modules.

    Dense weights (embeddings, norms, lm_head, biases) are placed on `device`; decoder NF4 weights
    are bound by the caller (`materialize_resident` or the streaming engine).
    """

    def __init__(self, store: NF4Store, cfg: TrainConfig, device: torch.device, host_io: bool = False):
        if store.double_quant != cfg.double_quant:
            raise ConfigError([f"double_quant: the run asks for {cfg.double_quant}, the store of {store.source} was "
                               f"built with {store.double_quant}; build it with build_store(..., "
                               f"double_quant={cfg.double_quant})"], source="TrainConfig")
        self.store, self.cfg, self.device = store, cfg, torch.device(device)
        model = skeleton(store.config)
        self.list_name, self.layers = decoder_layers(model)
        self.linear4bit = _to_linear4bit(self.list_name, self.layers, store.double_quant)
        # host_io: embeddings and lm_head stay in host memory (the streaming engine moves them)
        self.host_names = io_param_names(model) if host_io else set()
        for name, t in store.dense.items():
            _set_param(model, name, t if name in self.host_names else t.to(self.device))
        if getattr(store.config, "tie_word_embeddings", False) and "lm_head.weight" not in store.dense:
            model.lm_head.weight = model.get_input_embeddings().weight
        for name, t in store.buffers.items():  # as built or read from the checkpoint
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = t.to(self.device, copy=True)
        for mname, module in model.named_modules():
            for bname, buf in list(module._buffers.items()):
                if buf is not None and not buf.is_meta:
                    module._buffers[bname] = buf.to(self.device)
        self.code = store.code.to(self.device)
        self.nested_code = None if store.nested_code is None else store.nested_code.to(self.device)
        if cfg.loss_chunk is not None:  # before the LoRA wrapper, which calls the model's forward
            use_chunked_loss(model, cfg.loss_chunk)
        if cfg.mlp_chunk is not None:  # the MLP modules' forward: their LoRA layers, added later, run inside it
            use_chunked_mlp(self.layers, cfg.mlp_chunk)
        self.hf = model
        self.dropout_keys = DropoutKeys(cfg.seed)  # what the LoRA dropout masks are drawn from (lora_dropout > 0)

    def bind(self, slot: QuantSlot, tensors: SlotTensors) -> None:
        """Point `slot`'s Linear4bit at `tensors` (on the device)."""
        bind_nf4(self.linear4bit[slot.name], tensors, self.code, self.nested_code, slot.shape)

    def materialize_resident(self) -> None:
        """Ordinary QLoRA: every NF4 matrix copied to the device as its own tensors."""
        for slot in self.store.slots():
            self.bind(slot, slot_tensors(self.store.arena, slot).to(self.device))

    def add_lora(self) -> nn.Module:
        """Wrap with peft LoRA and initialise adapters from cfg.seed, independent of device."""
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(
            r=self.cfg.lora_rank,
            lora_alpha=self.cfg.lora_alpha,
            lora_dropout=self.cfg.lora_dropout,
            target_modules=list(self.cfg.lora_targets),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.peft = get_peft_model(self.hf, lcfg)
        if self.cfg.lora_compute is LoRACompute.BF16:
            lora_in_activation_dtype(self.peft)
        if self.cfg.lora_dropout > 0:  # peft's nn.Dropout draws from the global generator: keyed masks instead
            key_lora_dropout(self.peft, self.cfg.lora_dropout, self.dropout_keys)
        if self.cfg.attention_chunk is not None:  # on the LoRA layers, so that each chunk holds its adapters
            use_chunked_attention(self.layers, self.cfg.attention_chunk)
        gen = torch.Generator().manual_seed(self.cfg.seed + 7919)
        with torch.no_grad():
            for name, p in self.peft.named_parameters():
                if not p.requires_grad:
                    continue
                if ".lora_A." in name:
                    host = torch.empty(p.shape, dtype=p.dtype)
                    nn.init.kaiming_uniform_(host, a=math.sqrt(5), generator=gen)
                    p.copy_(host)
                elif ".lora_B." in name:
                    p.zero_()
        self.peft.train()
        return self.peft

    def lora_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.peft.named_parameters() if p.requires_grad]
