"""A trained adapter as `poros export --merge` and `poros generate` take it: the folder (never the run
folder around it), its LoRA pairs checked against each other and against what adapter_config.json says,
and its base checked against the one the run recorded.

An adapter is applied only where it belongs. Its tensors' shapes are the truth about its rank (a rank in
adapter_config.json that the tensors do not have is refused, as peft refuses to load it), every pair must
adapt a linear of the base in that linear's shape, and where the adapter sits in its run folder
(RUN/adapter or RUN/checkpoint/adapter), the base must be the checkpoint the run trained on: the run's
config.json records its weights by content (poros.finetune.fingerprints).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from poros.errors import CheckpointError

PEFT_PREFIX = "base_model.model."
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RUN_RECORD = "config.json"  # a run folder's record of its settings and fingerprints
# adapter_config.json settings under which the merged weight is not W + scaling * B @ A
UNMERGEABLE = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "fan_in_fan_out": "fan-in-fan-out (Conv1D) layers",
               "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
               "modules_to_save": "fully trained modules", "trainable_token_indices": "trained token embeddings",
               "layer_replication": "replicated layers"}


@dataclass
class Adapter:
    """A LoRA adapter read from its folder: the base's weight name -> (A, B), and the scaling of B @ A."""

    folder: Path
    config: dict
    rank: int
    scaling: float
    pairs: dict  # "model.layers.0.self_attn.q_proj.weight" -> (A (rank, in), B (out, rank))


def adapter_folder(path: str | Path, flag: str = "--adapter") -> Path:
    """`path` as an adapter folder; a run folder (or anything else) is refused naming what to pass.

    Raises:
        CheckpointError: not a peft adapter folder.
    """
    path = Path(path)
    if all((path / f).is_file() for f in ADAPTER_FILES):
        return path
    if (path / RUN_RECORD).is_file() and ((path / "adapter").is_dir() or (path / "checkpoint").is_dir()):
        inner = path / "adapter" if (path / "adapter").is_dir() else path / "checkpoint" / "adapter"
        raise CheckpointError(f"{flag} {path} is a run folder; pass its adapter: {flag} {inner}"
                              + ("" if inner.parent == path else " (the run's last checkpoint: it did not finish)"))
    if all((path / "adapter" / f).is_file() for f in ADAPTER_FILES):  # RUN/checkpoint
        raise CheckpointError(f"{flag} {path} holds an adapter; pass it: {flag} {path / 'adapter'}")
    if not path.exists():
        raise CheckpointError(f"{flag} {path}: no such folder; pass RUN/adapter of a finished run")
    raise CheckpointError(f"{flag} {path}: not a peft adapter folder (adapter_config.json and "
                          "adapter_model.safetensors); pass RUN/adapter of a finished run")


def read_adapter(path: str | Path) -> Adapter:
    """The LoRA pairs of an adapter folder, checked: every key a LoRA A or B of one module, each A with its
    B, one rank for all (the tensors' own, which adapter_config.json's `r` must state), and no setting
    under which the update is not `scaling * B @ A`.

    Raises:
        CheckpointError: naming the file and the first problem.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = adapter_folder(path)
    cfg_path, weights = folder / ADAPTER_FILES[0], folder / ADAPTER_FILES[1]
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not readable JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: expected a JSON object (peft's adapter config), got "
                              f"{type(cfg).__name__}")
    if "peft_type" not in cfg:
        raise CheckpointError(f"{cfg_path}: names no peft_type; expected the adapter_config.json peft writes "
                              f"beside its weights (peft_type LORA)")
    if cfg["peft_type"] != "LORA":
        raise CheckpointError(f"{cfg_path}: a {cfg['peft_type']} adapter; this takes LoRA adapters of nn.Linear "
                              f"layers")
    odd = [what for k, what in UNMERGEABLE.items() if cfg.get(k)]
    if odd:
        raise CheckpointError(f"{cfg_path}: an adapter with {odd[0]}; this takes plain LoRA adapters (one rank and "
                              "alpha for every module), as poros train writes them")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not (isinstance(r, int) and not isinstance(r, bool) and r > 0) or isinstance(alpha, bool) or \
            not isinstance(alpha, (int, float)) or not alpha > 0:
        raise CheckpointError(f"{cfg_path}: r {r!r} and lora_alpha {alpha!r}: expected positive numbers")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({str(e).splitlines()[0][:120]}); it is "
                              "truncated or corrupt: copy the adapter again") from None
    pairs: dict[str, list] = {}
    for key, t in tensors.items():
        part = next((p for p in (".lora_A.weight", ".lora_B.weight") if key.endswith(p)), None)
        if part is None or not key.startswith(PEFT_PREFIX) or t.dim() != 2 or not t.is_floating_point():
            raise CheckpointError(f"{weights}: {key} ({t.dtype}, {list(t.shape)}) is not a LoRA A or B matrix; this "
                                  "takes plain LoRA adapters, as poros train writes them")
        name = key[len(PEFT_PREFIX) : -len(part)] + ".weight"
        pairs.setdefault(name, [None, None])[part == ".lora_B.weight"] = t
    if not pairs:
        raise CheckpointError(f"{weights}: no LoRA weights")
    for name, (a, b) in sorted(pairs.items()):
        if a is None or b is None:
            raise CheckpointError(f"{weights}: {name[: -len('.weight')]} has lora_{'A' if a is None else 'B'} "
                                  "missing; copy the adapter again")
        if a.shape[0] != b.shape[1]:
            raise CheckpointError(f"{weights}: {name[: -len('.weight')]}'s lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)} are not a pair of one rank")
    ranks = sorted({a.shape[0] for a, _ in pairs.values()})
    if ranks != [r]:
        raise CheckpointError(f"{cfg_path} says r {r}, but the adapter's tensors have rank {', '.join(map(str, ranks))}"
                              f"; the config does not belong to these weights (scaling alpha/r would be wrong): "
                              "copy the adapter folder again")
    scaling = alpha / r ** 0.5 if cfg.get("use_rslora") else alpha / r
    return Adapter(folder, cfg, r, scaling, {k: (a, b) for k, (a, b) in pairs.items()})


def check_shapes(adapter: Adapter, model: Path, config) -> None:
    """Every pair adapts a linear of `config`'s model (the base's own module names) in that linear's shape.

    Raises:
        CheckpointError: naming the first weight the base lacks or has in another shape.
    """
    from torch import nn

    from poros.models.skeleton import skeleton

    linears = {f"{n}.weight": (m.out_features, m.in_features) for n, m in skeleton(config).named_modules()
               if isinstance(m, nn.Linear)}
    for name, (a, b) in sorted(adapter.pairs.items()):
        want = linears.get(name)
        if want is None:
            raise CheckpointError(f"{adapter.folder} adapts {name}, which {model} does not have; pass the checkpoint "
                                  "the run trained on")
        if want != (b.shape[0], a.shape[1]):
            raise CheckpointError(f"{adapter.folder} adapts {name} as {b.shape[0]} x {a.shape[1]}, but {model} has "
                                  f"it as {want[0]} x {want[1]}; pass the checkpoint the run trained on")


def run_record(adapter: Adapter) -> tuple[Path, dict] | None:
    """The record of the run the adapter belongs to (RUN/adapter or RUN/checkpoint/adapter), if it is there."""
    for run in (adapter.folder.parent, adapter.folder.parent.parent):
        path = run / RUN_RECORD
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("fingerprints"), dict):
            return path, record
    return None


def check_base(adapter: Adapter, model: Path, say) -> None:
    """The base is the checkpoint the adapter's run trained on, by the weights' content as the run recorded
    it. An NF4 checkpoint and the bf16 one it was quantized from hold other bytes: between those two only the
    shapes are checked, and `say` tells so in one line, as it does for an adapter outside its run folder.

    Raises:
        CheckpointError: the run recorded other weights.
    """
    from poros.finetune.fingerprints import weights_fingerprint
    from poros.store.nf4_checkpoint import is_bnb_checkpoint

    found = run_record(adapter)
    if found is None:
        say(f"note: {adapter.folder} is not inside its run folder (no RUN/config.json), so its base is checked by "
            "shapes only")
        return
    path, record = found
    recorded = record["fingerprints"].get("weights")
    if not isinstance(recorded, str):
        say(f"note: {path} records no fingerprint of the base's weights, so the base is checked by shapes only")
        return
    if weights_fingerprint(model) == recorded:
        return
    trained_on = (record.get("settings") or {}).get("model", "?")
    nf4_then = record["fingerprints"].get("weights_format")
    nf4_then = nf4_then == "nf4" if nf4_then is not None else is_bnb_checkpoint(Path(trained_on))
    if nf4_then != is_bnb_checkpoint(model):
        say(f"note: the run trained on {'an NF4' if nf4_then else 'a bf16'} checkpoint ({trained_on}) and {model} is "
            f"{'NF4' if not nf4_then else 'bf16'}: their bytes differ, so the base is checked by shapes only")
        return
    raise CheckpointError(f"{adapter.folder} was trained on other weights than {model} holds (its run {path.parent} "
                          f"trained on {trained_on}: sampled sha256 {recorded[:12]}, {model}: "
                          f"{weights_fingerprint(model)[:12]}); pass the checkpoint the run trained on")
