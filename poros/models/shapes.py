"""Named model shapes, built with transformers' own config classes.

Real shapes reproduce the published config.json of each checkpoint (text model only);
tiny shapes keep the same model_type and code paths at toy size for CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from poros.errors import UnknownModelError

if TYPE_CHECKING:  # imported where a config is made: the registry's names alone load no transformers
    import transformers

_S, _F = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ModelShape:
    """A named decoder-only text model shape."""

    name: str
    arch: str  # "qwen2" | "qwen3" | "gemma3" | "gemma4"
    published_params: float | None  # published total of the text model; None for tiny shapes
    factory: Callable[[], transformers.PretrainedConfig]
    tiny: bool

    def config(self) -> transformers.PretrainedConfig:
        """A fresh config, safe to mutate."""
        return self.factory()

    def cut(self, layers: int) -> transformers.PretrainedConfig:
        """A fresh config of this shape with only its first `layers` decoder layers, each of its own attention kind:
        a model whose steps measure one layer's device memory or time in seconds (scripts/memory_probe.py).

        Raises:
            ValueError: `layers` is not between 1 and the shape's number of layers.
        """
        config = self.factory()
        if not 1 <= layers <= config.num_hidden_layers:
            raise ValueError(f"{self.name} has {config.num_hidden_layers} decoder layers: a cut keeps 1 to "
                             f"{config.num_hidden_layers}, not {layers}")
        config.num_hidden_layers = layers
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = min(config.max_window_layers, layers)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:layers]
        return config


# Qwen2 has no attention_bias field: its q/k/v projections always carry a bias.
def _qwen2(**kw) -> transformers.Qwen2Config:
    import transformers

    return transformers.Qwen2Config(**{
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "use_sliding_window": False, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151643, "use_cache": False, **kw,
    })


def _qwen3(**kw) -> transformers.Qwen3Config:
    import transformers

    return transformers.Qwen3Config(**{
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "use_cache": False, **kw,
    })


def _gemma3(**kw) -> transformers.Gemma3TextConfig:
    import transformers

    return transformers.Gemma3TextConfig(
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, use_cache=False, **kw,
    )


# global_head_dim / num_global_key_value_heads are not config fields: Gemma4TextConfig turns
# them into per_layer_config overrides for the full-attention layers (same in 5.17 and 5.24).
def _gemma4(**kw) -> transformers.Gemma4TextConfig:
    import transformers

    return transformers.Gemma4TextConfig(
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        attention_k_eq_v=True, num_kv_shared_layers=0, hidden_size_per_layer_input=0,
        enable_moe_block=False, use_double_wide_mlp=False, use_bidirectional_attention="vision",
        final_logit_softcapping=30.0, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=2, eos_token_id=1, use_cache=False, **kw,
    )


# https://huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
def qwen25_32b() -> transformers.Qwen2Config:
    return _qwen2(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
        sliding_window=131072, max_window_layers=64,
    )


# https://huggingface.co/Qwen/Qwen2.5-72B/blob/main/config.json
def qwen25_72b() -> transformers.Qwen2Config:
    return _qwen2(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        sliding_window=131072, max_window_layers=80,
    )


# https://huggingface.co/Qwen/Qwen3-32B/blob/main/config.json
def qwen3_32b() -> transformers.Qwen3Config:
    return _qwen3(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        max_window_layers=64,
    )


# text_config of https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json; fields it
# omits (vocab 262208, rope thetas, 131072 positions) are the Gemma3TextConfig defaults.
def gemma3_27b() -> transformers.Gemma3TextConfig:
    return _gemma3(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
        max_position_embeddings=131072, sliding_window=1024,
        layer_types=[_F if (i + 1) % 6 == 0 else _S for i in range(62)],
    )


# text_config of https://huggingface.co/google/gemma-4-31B/blob/main/config.json
def gemma4_31b() -> transformers.Gemma4TextConfig:
    return _gemma4(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
        num_attention_heads=32, num_key_value_heads=16, head_dim=256,
        global_head_dim=512, num_global_key_value_heads=4,
        max_position_embeddings=262144, sliding_window=1024, layer_types=([_S] * 5 + [_F]) * 10,
    )


# Tiny shapes: 5 layers so block sizes 2 and 4 leave a remainder; every Linear in/out
# feature is a multiple of 64 (bitsandbytes blocks); sliding_window 32 < test seq len 64-128.
_TINY = dict(vocab_size=1024, intermediate_size=256, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048)


# Qwen token ids (151643+) would fall outside the tiny vocab.
_TINY_QWEN_IDS = dict(bos_token_id=None, eos_token_id=1)


def tiny_qwen2() -> transformers.Qwen2Config:
    return _qwen2(hidden_size=128, max_window_layers=5, **_TINY_QWEN_IDS, **_TINY)


# hidden 64 with 4x32 heads keeps q wider than hidden_size, as in Qwen3-32B and both Gemmas.
def tiny_qwen3() -> transformers.Qwen3Config:
    return _qwen3(hidden_size=64, head_dim=32, max_window_layers=5, **_TINY_QWEN_IDS, **_TINY)


def tiny_gemma3() -> transformers.Gemma3TextConfig:
    return _gemma3(
        hidden_size=64, head_dim=32, query_pre_attn_scalar=16, sliding_window=32,
        layer_types=[_S, _S, _F, _S, _S], **_TINY,
    )


# Mirrors 31B: wider global heads, fewer global kv heads with k_eq_v, last layer full attention.
def tiny_gemma4() -> transformers.Gemma4TextConfig:
    return _gemma4(
        hidden_size=64, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        sliding_window=32, layer_types=[_S, _S, _F, _S, _F], **_TINY,
    )


# Published totals: Qwen model cards ("Number of Parameters"; the 32B card's 32.5B is low, its
# config gives 32.76B); Gemma 3 report Table 1 (1,416M embedding + 25,600M non-embedding, vision
# encoder excluded); Gemma 4 model card (31B dense: 30.7B).
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("qwen2.5-32b", "qwen2", 32.5e9, qwen25_32b, False),
        ModelShape("qwen2.5-72b", "qwen2", 72.7e9, qwen25_72b, False),
        ModelShape("qwen3-32b", "qwen3", 32.8e9, qwen3_32b, False),
        ModelShape("gemma3-27b", "gemma3", 27.016e9, gemma3_27b, False),
        ModelShape("gemma4-31b", "gemma4", 30.7e9, gemma4_31b, False),
        ModelShape("tiny-qwen2", "qwen2", None, tiny_qwen2, True),
        ModelShape("tiny-qwen3", "qwen3", None, tiny_qwen3, True),
        ModelShape("tiny-gemma3", "gemma3", None, tiny_gemma3, True),
        ModelShape("tiny-gemma4", "gemma4", None, tiny_gemma4, True),
    )
}


def get_shape(name: str) -> ModelShape:
    """The shape registered under `name`; raises UnknownModelError otherwise."""
    try:
        return SHAPES[name]
    except KeyError:
        raise UnknownModelError(f"unknown model {name!r}; known: {', '.join(SHAPES)}") from None


def count_params(config: transformers.PretrainedConfig) -> int:
    """Total parameters of the causal LM for `config`, built on the meta device; tied weights count once."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # from_config leaves meta-device weights untied
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
