"""What the planner needs of a model: its layers' places in the store's arena and the widths the memory
model sizes activations by, from the model's config alone (its module tree on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass

from poros.store.layout import plan_layout


@dataclass(frozen=True)
class Geometry:
    """What the planner needs of a model, from its config alone (no weights)."""

    name: str
    layer_starts: tuple[int, ...]  # arena byte offset of each decoder layer
    layer_ends: tuple[int, ...]
    head_bytes: int  # the lm_head weight (bf16)
    hidden: int
    vocab: int
    intermediate: int
    heads: int  # attention heads of the widest layer
    q_width: int  # query elements per token of the widest layer (heads x head_dim)
    max_linear: int  # elements of the largest decoder linear weight
    lora_in_out: tuple[int, ...]  # per LoRA-able linear of every layer: in + out features
    dense_device_bytes: int  # norms, biases and buffers the device holds for every method
    store_bytes: int = 0  # the NF4 store in host memory: the arena and every dense weight (poros/store/host_memory.py)
    kv_width: int = 0  # key elements per token of the widest layer (key/value heads x head_dim); 0: as q_width
    # some layers attend through a mask (a sliding window: `layer_types` other than full_attention) or with head dims
    # over 128, which FlashAttention-4 leaves to SDPA (`fused_backward_bytes`); unknown: as if so
    other_attention: bool = True

    @property
    def n_layers(self) -> int:
        return len(self.layer_starts)

    @classmethod
    def of_config(cls, name: str, config, lora_targets, double_quant: bool = False) -> "Geometry":
        """From `config`'s shapes; `double_quant`: the store's slots are double-quantized (smaller)."""
        from torch import nn

        from poros.models.skeleton import decoder_layers, layer_linears, skeleton
        from poros.store.host_memory import host_need

        model = skeleton(config)
        list_name, layers = decoder_layers(model)
        linears = [layer_linears(layer, f"{list_name}.{i}") for i, layer in enumerate(layers)]
        layouts, arena = plan_layout(linears, double_quant)
        head = model.get_output_embeddings().weight
        lora = tuple(a + b for layer in linears for n, (b, a) in layer if n.rsplit(".", 1)[-1] in lora_targets)
        dense = 0
        for mname, m in model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if isinstance(m, nn.Linear) and pname == "weight" or isinstance(m, nn.Embedding):
                    continue
                if p is head:
                    continue
                dense += p.numel() * 2
            dense += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False) if b is not None)
        # per layer, from the modules (gemma4's layers differ in head_dim and MLP width)
        attn = [m for m in model.modules() if hasattr(m, "q_proj") and isinstance(getattr(m, "head_dim", None), int)]
        heads = max((m.q_proj.out_features // m.head_dim for m in attn), default=1)
        q_width = max((m.q_proj.out_features for m in attn), default=config.hidden_size)
        head_dims = {m.head_dim for m in attn}
        types = set(getattr(config, "layer_types", None) or ())
        other_attention = bool(types - {"full_attention"}) or getattr(config, "use_sliding_window", False) is True \
            or any(d > 128 for d in head_dims)
        kv_width = max((m.k_proj.out_features for m in attn if isinstance(getattr(m, "k_proj", None), nn.Linear)),
                       default=q_width)
        mlp = [shape[0] for layer in linears for n, shape in layer if n.endswith(("gate_proj", "up_proj", "fc1"))]
        return cls(
            name=name, layer_starts=tuple(x.start for x in layouts), layer_ends=tuple(x.end for x in layouts),
            head_bytes=head.numel() * 2, hidden=config.hidden_size, vocab=config.vocab_size,
            intermediate=max(mlp, default=4 * config.hidden_size), heads=heads, q_width=q_width,
            max_linear=max(a * b for layer in linears for _, (a, b) in layer),
            lora_in_out=lora, dense_device_bytes=dense, store_bytes=host_need(model, layers, arena, "meta").store,
            kv_width=kv_width, other_attention=other_attention)
