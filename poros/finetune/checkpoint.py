"""A `poros train` run's checkpoint: `RUN/checkpoint/` holds the peft adapter, AdamW's state, the RNG states
and `state.json` (step, data position), every tensor the next step reads.

It is written whole or not at all (`checkpoint.partial/`, then swapped in; a save cut off between its two
renames leaves `checkpoint.old/`, which `recover_checkpoint` takes back), and checked before a resumed run
builds anything (`check_checkpoint`): a damaged file is named in one line with what can be done, and
nothing in the run folder is touched.
"""

from __future__ import annotations

import copy
import json
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import torch

from poros.errors import CheckpointError, PorosError

CHECKPOINT, OLD, PARTIAL = "checkpoint", "checkpoint.old", "checkpoint.partial"
ADAPTER_WEIGHTS = "adapter/adapter_model.safetensors"
TENSOR_FILES = ("optimizer.pt", "rng.pt")  # torch.save's zip archives


def _adapter_keys(trainer) -> dict[str, torch.nn.Parameter]:
    """peft's saved key (adapter name removed) for each trainable LoRA parameter."""
    from peft.utils import get_peft_model_state_dict

    params = {n: p for n, p in trainer.params}
    by_id = {id(p): p for p in params.values()}
    sd = get_peft_model_state_dict(trainer.qlora.peft, state_dict=params, save_embedding_layers=False)
    keys = {k: by_id[id(v)] for k, v in sd.items() if id(v) in by_id}
    if len(keys) != len(params):
        raise PorosError(f"peft names {len(keys)} of the {len(params)} LoRA parameters; cannot save the adapter")
    return keys


def write_adapter(trainer, folder: Path, base_model: str) -> Path:
    """The trainer's LoRA weights as a peft adapter folder (adapter_config.json,
    adapter_model.safetensors) for `PeftModel.from_pretrained(base_model, folder)`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: p.detach().to("cpu").contiguous() for k, p in _adapter_keys(trainer).items()}
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(trainer.qlora.peft.peft_config["default"])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    config.save_pretrained(str(folder))
    return folder


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(trainer, run: Path, state: dict, base_model: str) -> Path:
    """Write checkpoint/ whole or not at all: into checkpoint.partial/, then swapped in."""
    tmp, final, old = run / PARTIAL, run / CHECKPOINT, run / OLD
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write_adapter(trainer, tmp / "adapter", base_model)
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
    except BaseException:  # a full disk, say: the previous checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def recover_checkpoint(run: Path) -> None:
    """A save cut off between its two renames leaves only checkpoint.old: take it back."""
    if not (run / CHECKPOINT).exists() and (run / OLD).exists():
        (run / OLD).rename(run / CHECKPOINT)


def damage(folder: Path) -> tuple[Path, str] | None:
    """The first file of a checkpoint folder that a resumed run could not read, and why (None: none)."""
    from safetensors import SafetensorError, safe_open

    state = folder / "state.json"
    try:
        s = json.loads(state.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return state, "missing"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return state, f"not readable JSON ({str(e).splitlines()[0][:80]})"
    if not (isinstance(s, dict) and all(isinstance(s.get(k), int) and not isinstance(s.get(k), bool) and s[k] >= 0
                                        for k in ("step", "position"))):
        return state, "expected an object with the step and data position as integers"
    for name in ("adapter/adapter_config.json", ADAPTER_WEIGHTS, *TENSOR_FILES):
        if not (folder / name).is_file():
            return folder / name, "missing"
    try:
        with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
            list(f.keys())
    except (SafetensorError, OSError) as e:
        return folder / ADAPTER_WEIGHTS, f"not a readable safetensors file ({str(e).splitlines()[0][:80]})"
    for name in TENSOR_FILES:
        if not zipfile.is_zipfile(folder / name):
            return folder / name, "truncated or not what torch.save writes"
    return None


def check_checkpoint(run: Path) -> dict:
    """The state.json of RUN/checkpoint/ once every file a resumed run reads is there and readable.

    Raises:
        CheckpointError: naming the damaged file and what can be done: the previous checkpoint where one is
            kept (checkpoint.old/, of a save cut off after its swap), else a new run.
    """
    found = damage(run / CHECKPOINT)
    if found is None:
        return json.loads((run / CHECKPOINT / "state.json").read_text(encoding="utf-8"))
    path, why = found
    if (run / OLD).is_dir() and damage(run / OLD) is None:
        step = json.loads((run / OLD / "state.json").read_text(encoding="utf-8"))["step"]
        what = (f"the previous checkpoint (step {step}) is kept in {run / OLD}: move {run / CHECKPOINT} aside, rename "
                f"{OLD} to {CHECKPOINT} and resume from it")
    else:
        what = f"no earlier checkpoint is kept: start again in a new --out ({run} is left as it is)"
    raise CheckpointError(f"{path}: {why}; the run cannot resume from this checkpoint: {what}")


def load_checkpoint(trainer, folder: Path) -> dict:
    """Restore LoRA weights, AdamW state and RNG states saved by `save_checkpoint`; returns state.json.

    Raises:
        CheckpointError: a file that does not load or does not fit the model, named.
    """
    from safetensors.torch import load_file

    def loaded(name, read):
        try:
            return read(folder / name)
        except (RuntimeError, OSError, EOFError, ValueError, KeyError, TypeError, pickle.UnpicklingError,
                zipfile.BadZipFile) as e:
            raise CheckpointError(f"{folder / name}: cannot be read ({str(e).splitlines()[0][:120]}); the run cannot "
                                  "resume from this checkpoint: start again in a new --out") from None

    saved = loaded(ADAPTER_WEIGHTS, lambda p: load_file(str(p)))
    keys = _adapter_keys(trainer)
    if set(saved) != set(keys):
        missing, extra = sorted(set(keys) - set(saved)), sorted(set(saved) - set(keys))
        raise CheckpointError(f"{folder}: the adapter does not match the model: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}")
    bad = next((k for k, p in keys.items() if saved[k].shape != p.shape), None)
    if bad is not None:
        raise CheckpointError(f"{folder / ADAPTER_WEIGHTS}: {bad} has shape {list(saved[bad].shape)}, the model's "
                              f"{list(keys[bad].shape)}; the checkpoint does not belong to this run's settings")
    with torch.no_grad():
        for k, p in keys.items():
            p.copy_(saved[k])
    device = trainer.params[0][1].device
    state = loaded("optimizer.pt", lambda p: torch.load(p, map_location=device, weights_only=True))
    loaded("optimizer.pt", lambda p: trainer.optimizer.load_state_dict(state))
    loaded("rng.pt", lambda p: _set_rng_state(torch.load(p, weights_only=True)))
    return json.loads((folder / "state.json").read_text())
