"""Building the NF4 store: deterministic synthetic builds, exact checkpoint loading, one layer at a time,
and one-line errors for bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import poros.store.build
from poros.models.skeleton import skeleton as make_skeleton
from poros.models.checkpoint import Source, resolve
from poros.store.build import build_store
from poros.models.skeleton import check_seq_len, decoder_layers
from poros.config import TrainConfig
from poros.errors import CheckpointError, ConfigError, UnknownModelError
from poros.models.shapes import SHAPES, get_shape
from poros.store.arena import absmax_view, weight_view
from poros.store.layout import NF4_BLOCKSIZE
from tests.capabilities import requires_bitsandbytes

TINY = [name for name, s in SHAPES.items() if s.tiny]


def assert_all_equal(what: str, expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """torch.equal on every tensor; the failure names the first tensor that differs and by how much."""
    assert sorted(got) == sorted(expected), (
        f"{what}: names differ; missing {sorted(set(expected) - set(got))}, extra {sorted(set(got) - set(expected))}"
    )
    for name in expected:
        a, b = expected[name], got[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            pytest.fail(f"{what}: {name} is {b.dtype}{tuple(b.shape)}, expected {a.dtype}{tuple(a.shape)}")
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            pytest.fail(f"{what}: first differing tensor {name}: max |diff| {diff.max():.3e} "
                        f"at {diff.numel() - int((diff == 0).sum())} of {diff.numel()} elements")


def nf4_slots(store) -> dict[str, torch.Tensor]:
    out = {}
    for slot in store.slots():
        out[f"{slot.name}.weight"] = weight_view(store.arena, slot).clone()
        out[f"{slot.name}.absmax"] = absmax_view(store.arena, slot).clone()
    return out


# --- (a) synthetic builds are a pure function of their seed ----------------------------------


@requires_bitsandbytes
@pytest.mark.parametrize("model", TINY, ids=[f"model={m}" for m in TINY])
def test_synthetic_build_is_deterministic(model):
    a, stats = build_store(model, seed=0, progress=False)
    b, _ = build_store(model, seed=0, progress=False)
    c, _ = build_store(model, seed=1, progress=False)
    assert stats.layers == get_shape(model).config().num_hidden_layers
    assert a.nbytes == stats.store_bytes == b.nbytes == c.nbytes
    assert torch.equal(a.arena, b.arena), f"{model}: two seed-0 builds give different arena bytes"
    assert_all_equal(f"{model} dense (seed 0 twice)", a.dense, b.dense)
    assert torch.equal(a.code, b.code)
    assert not torch.equal(a.arena, c.arena), f"{model}: seed 1 gives the same arena as seed 0"
    embed = "model.embed_tokens.weight"
    assert not torch.equal(a.dense[embed], c.dense[embed]), f"{model}: seed 1 gives the same {embed}"
    # Every NF4 slot (not just one) changes with `seed`: no layer ignores it.
    same = [s.name for s in a.slots() if torch.equal(weight_view(a.arena, s), weight_view(c.arena, s))]
    assert not same, f"{model}: seed 1 leaves these NF4 matrices unchanged: {same}"


class _PoisonedTorch:
    """poros.store.arena's `torch`, except that torch.empty returns memory filled with `fill`.

    torch.empty promises nothing about its contents; poisoning makes "uninitialised" visible
    deterministically instead of depending on what the allocator happens to recycle.
    """

    def __init__(self, fill: int):
        self.fill = fill

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(self.fill) if t.dtype == torch.uint8 else t


@requires_bitsandbytes
def test_synthetic_build_is_deterministic_with_alignment_padding(monkeypatch):
    import poros.store.arena

    config = get_shape("tiny-qwen2").config()  # head_dim 24: q_proj absmax is 576 bytes, padded to 768
    config.hidden_size, config.intermediate_size, config.head_dim = 96, 160, 24
    arenas = []
    for fill in (0xAB, 0x5C):
        monkeypatch.setattr(poros.store.arena, "torch", _PoisonedTorch(fill))
        store, _ = build_store(Source("tiny-qwen2-unaligned", config), seed=0, progress=False)
        arenas.append(store.arena)
    a, b = arenas
    assert a.nbytes == b.nbytes
    differ = int((a != b).sum())
    assert differ == 0, f"two seed-0 builds differ in {differ} of {a.numel()} arena bytes"


# --- (b) checkpoint loading is exactly bitsandbytes' quantization of the saved weights --------


def _save_tiny(model: str, path: Path, max_shard_size: str | None) -> dict[str, torch.Tensor]:
    """Save a seeded tiny model with transformers; return what landed in the safetensors files."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(get_shape(model).config(), dtype=torch.bfloat16)
    with torch.no_grad():  # non-trivial norms and biases too (their default init is all ones/zeros)
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    hf.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    saved = {}
    for f in sorted(path.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    return saved


@requires_bitsandbytes
@pytest.mark.parametrize(
    "model,shards",
    [("tiny-qwen2", "200KB"), ("tiny-gemma3", None)],
    ids=["model=tiny-qwen2-save=sharded", "model=tiny-gemma3-save=single-file-tied"],
)
def test_checkpoint_round_trip_is_exact(tmp_path, model, shards):
    import bitsandbytes.functional as bnbf

    saved = _save_tiny(model, tmp_path, shards)
    if shards:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2, "expected several shards"
    else:
        assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
        assert "lm_head.weight" not in saved, "tied lm_head should not be saved"

    store, stats = build_store(str(tmp_path), progress=False)
    assert stats.layers == get_shape(model).config().num_hidden_layers

    expected_nf4 = {}
    for slot in store.slots():
        w = saved[f"{slot.name}.weight"]
        assert tuple(w.shape) == slot.shape
        packed, state = bnbf.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, compress_statistics=False, quant_type="nf4")
        expected_nf4[f"{slot.name}.weight"] = packed.reshape(-1, 1)
        expected_nf4[f"{slot.name}.absmax"] = state.absmax.float()
    assert expected_nf4, "no NF4 slots"
    assert_all_equal(f"{model} NF4 slots", expected_nf4, nf4_slots(store))

    quantized = {f"{s.name}.weight" for s in store.slots()}
    expected_dense = {k: v for k, v in saved.items() if k not in quantized}
    assert_all_equal(f"{model} dense", expected_dense, store.dense)


# --- (c) the build holds one decoder layer materialised at a time ----------------------------


@requires_bitsandbytes
def test_build_materialises_one_layer_at_a_time(monkeypatch):
    config = get_shape("tiny-qwen2").config()
    config.num_hidden_layers = config.max_window_layers = 8
    config.layer_types = ["full_attention"] * 8
    captured = {}
    real_skeleton, real_quantize = make_skeleton, poros.store.build.quantize_nf4

    def skeleton(cfg):
        captured["model"] = model = real_skeleton(cfg)
        captured["layers"] = decoder_layers(model)[1]
        return model

    def live_layers() -> list[int]:
        return [i for i, layer in enumerate(captured["layers"]) if any(not p.is_meta for p in layer.parameters())]

    def live_outside_layers() -> list[str]:
        inside = {id(p) for p in captured["layers"].parameters()}
        return [n for n, p in captured["model"].named_parameters() if id(p) not in inside and not p.is_meta]

    seen_during_quantize: list[tuple[list[int], list[str]]] = []

    def quantize(w, double_quant):
        seen_during_quantize.append((live_layers(), live_outside_layers()))
        return real_quantize(w, double_quant)

    seen_on_layer: list[tuple[int, int, list[int]]] = []
    monkeypatch.setattr(poros.store.build, "skeleton", skeleton)
    monkeypatch.setattr(poros.store.build, "quantize_nf4", quantize)
    store, stats = build_store(Source("tiny-qwen2-8l", config), progress=False,
                               on_layer=lambda done, total: seen_on_layer.append((done, total, live_layers())))

    assert stats.layers == 8
    assert [(d, t) for d, t, _ in seen_on_layer] == [(i, 8) for i in range(1, 9)]
    leaked = [(d, live) for d, _, live in seen_on_layer if live]
    assert not leaked, f"layers still materialised after their on_layer callback: {leaked}"
    per_layer = len(store.layers[0].slots)
    assert len(seen_during_quantize) == 8 * per_layer
    for k, (live, outside) in enumerate(seen_during_quantize):
        layer = k // per_layer
        assert live == [layer], f"while quantizing layer {layer}, materialised layers were {live}"
        assert not outside, f"while quantizing layer {layer}, non-layer weights were materialised: {outside}"
    assert all(p.is_meta for p in captured["model"].parameters()), "build left weights on the skeleton"


# --- (d) bad inputs: one-line errors that name the value -------------------------------------


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


def test_unknown_model_name():
    with pytest.raises(UnknownModelError) as e:
        build_store("nope", progress=False)
    msg = _one_line(e.value)
    assert "'nope'" in msg
    assert all(n in msg for n in SHAPES), f"known names not listed: {msg}"


def test_folder_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        build_store(str(tmp_path), progress=False)
    msg = _one_line(e.value)
    assert "config.json" in msg and str(tmp_path) in msg


def test_missing_folder_is_named(tmp_path):
    missing = str(tmp_path / "not-there")
    with pytest.raises(CheckpointError) as e:
        resolve(missing)
    assert missing in _one_line(e.value)


def test_index_naming_a_missing_shard(tmp_path):
    _save_tiny("tiny-qwen2", tmp_path, "200KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    victim = shards[len(shards) // 2]
    victim.unlink()
    with pytest.raises(CheckpointError) as e:
        build_store(str(tmp_path), progress=False)
    assert victim.name in _one_line(e.value)


def test_architecture_without_layer_list():
    with pytest.raises(CheckpointError) as e:
        decoder_layers(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)])))
    assert "Sequential" in _one_line(e.value)


def test_decoder_layers_finds_the_list():
    name, layers = decoder_layers(make_skeleton(get_shape("tiny-qwen3").config()))
    assert name == "model.layers" and len(layers) == 5


@pytest.mark.parametrize("rank", [0, -4], ids=["lora_rank=0", "lora_rank=-4"])
def test_lora_rank_must_be_positive(rank):
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen2", lora_rank=rank)
    assert len(e.value.problems) == 1
    assert "lora_rank" in e.value.problems[0] and repr(rank) in e.value.problems[0]
    _one_line(e.value)


def test_all_config_problems_listed_at_once():
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen2", lora_rank=0, seq_len=-1, attention="warp")
    text = " | ".join(e.value.problems)
    for field in ("lora_rank", "seq_len", "attention"):
        assert field in text, f"{field} not reported: {text}"


def test_seq_len_beyond_max_positions():
    config = get_shape("tiny-qwen2").config()
    limit = config.max_position_embeddings
    check_seq_len(config, limit)  # the limit itself is allowed
    with pytest.raises(ConfigError) as e:
        check_seq_len(config, limit + 1)
    msg = _one_line(e.value)
    assert "seq_len" in msg and str(limit + 1) in msg and str(limit) in msg


@requires_bitsandbytes
def test_trainer_refuses_seq_len_beyond_max_positions():
    from poros.engine.methods.trainer import ResidentTrainer

    store, _ = build_store("tiny-qwen2", progress=False)
    too_long = store.config.max_position_embeddings * 2
    with pytest.raises(ConfigError) as e:
        ResidentTrainer(store, TrainConfig(model="tiny-qwen2", seq_len=too_long))
    assert "seq_len" in _one_line(e.value) and str(too_long) in str(e.value)


@pytest.mark.parametrize(
    "argv,named",
    [
        (["parity", "--model", "nope", "--steps", "1"], "nope"),
        (["parity", "--model", "tiny-qwen2", "--lora-rank", "0", "--steps", "1"], "lora_rank"),
    ],
    ids=["cli=parity-model=nope", "cli=parity-lora-rank=0"],
)
def test_cli_bad_input_is_one_line_exit_2(capsys, argv, named):
    from poros.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}; stderr: {err!r}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert named in lines[0] and "Traceback" not in err
    assert out == ""


@requires_bitsandbytes
def test_checkpoint_buffers_are_read_used_and_exported(tmp_path):
    """gemma4 keeps a learned `layer_scalar` per layer as a persistent buffer: it must come from the
    checkpoint (not the constructor's 1.0), reach the model, and be written by the export (Unsloth
    reported it MISSING before)."""
    import transformers
    from safetensors.torch import load_file

    from poros.config import TrainConfig
    from poros.store.export import export_bnb4bit
    from poros.engine.model.qlora import QLoRAModel

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(get_shape("tiny-gemma4").config(), dtype=torch.bfloat16)
    scalars = {}
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.25 + len(scalars) / 8)
                scalars[name] = b.clone()
    assert scalars, "tiny-gemma4 has no layer_scalar buffers any more"
    hf.save_pretrained(str(tmp_path / "ckpt"))
    store, _ = build_store(str(tmp_path / "ckpt"), progress=False)
    for name, value in scalars.items():
        assert torch.equal(store.buffers[name], value), name
    model = QLoRAModel(store, TrainConfig(model="tiny-gemma4"), torch.device("cpu"))
    live = dict(model.hf.named_buffers())
    for name, value in scalars.items():
        assert torch.equal(live[name], value), name
    out = export_bnb4bit(store, tmp_path / "export")
    exported = {}
    for f in out.glob("*.safetensors"):
        exported.update(load_file(str(f)))
    for name, value in scalars.items():
        assert torch.equal(exported[name], value), name
    # a synthetic build records the constructed values, so the export is complete too
    synthetic, _ = build_store("tiny-gemma4", progress=False)
    assert set(synthetic.buffers) == set(scalars)
    assert all(torch.equal(b, torch.ones_like(b)) for b in synthetic.buffers.values())


def _cpu_matrices_made(make, monkeypatch) -> int:
    """How many 2-D tensors `make()` creates in CPU memory through torch.empty."""
    made, real = [], torch.empty

    def recorded(*args, **kwargs):
        t = real(*args, **kwargs)
        made.append(t)
        return t

    monkeypatch.setattr(torch, "empty", recorded)
    make()
    monkeypatch.setattr(torch, "empty", real)
    return sum(1 for t in made if t.device.type == "cpu" and t.dim() == 2)


def test_the_skeleton_allocates_no_weight_on_the_cpu(monkeypatch):
    """Every linear and embedding weight is made on the meta device; accelerate's init_empty_weights alone
    (the control) allocates each on the CPU first, then moves it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = get_shape("tiny-qwen3").config()
    model = make_skeleton(config)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}  # rotary tables stay real
    assert _cpu_matrices_made(lambda: make_skeleton(config), monkeypatch) == 0

    def control():
        with init_empty_weights(include_buffers=False):
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)

    assert _cpu_matrices_made(control, monkeypatch) > 0
    assert nn.Linear(4, 4).weight.device.type == "cpu"  # the constructors are themselves again
