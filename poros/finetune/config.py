"""A `poros train` run as data: `FinetuneConfig`, its stored form (the run file, YAML), `key=value`
overrides, and the defaults a run takes on a GPU.

A run file holds the settings table's names (poros/settings.py) and the run's own keys (`RUN_KEYS`):

    model: ./Qwen3-32B
    data: chats.jsonl
    out: runs/qwen3
    steps: 1000
    lr: 1e-4            # YAML 1.2 numbers: 1e-4 is a number
    lora_targets: [q_proj, v_proj]

The command line adds to it and overrides it: first the run file, then the flags, then `key=value`
words. The run folder keeps the resolved configuration as `run.yaml`, a run file that repeats (or,
with --resume, continues) the run. Relative paths are read from the working directory.

A setting left unset takes the device's default (poros/resolve.py `DEVICE_DEFAULTS`: on CUDA the fastest exact
path, unless a setting given refuses it), then the table's.
"""

from __future__ import annotations

import difflib
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from poros.choices import Device, LRSchedule
from poros.common.yamlfile import load_yaml
from poros.config import BY_NAME, Method, TrainConfig
from poros.engine.methods import FINETUNE_METHODS, METHODS
from poros.errors import ConfigError
from poros.paths import unreadable
from poros.resolve import with_defaults

MAX_STEPS = 2**62  # positions in the data are steps x sequences a step, kept in 64 bits
RUN_KEYS = ("model", "data", "out", "steps", "method", "save_every", "eval_data", "eval_split")
REQUIRED = ("model", "data", "out", "steps")
KEYS = (*RUN_KEYS, *BY_NAME)
# names other trainers' configs use (Transformers/TRL, Axolotl, torchtune), suggested when one is given
OTHER_NAMES = {"learning_rate": "lr", "max_steps": "steps", "num_steps": "steps", "output_dir": "out",
               "dataset": "data", "datasets": "data", "base_model": "model", "model_name_or_path": "model",
               "lora_r": "lora_rank", "r": "lora_rank", "target_modules": "lora_targets",
               "lora_target_modules": "lora_targets", "micro_batch_size": "batch_size",
               "per_device_train_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum",
               "sequence_len": "seq_len", "max_seq_length": "seq_len", "max_seq_len": "seq_len",
               "save_steps": "save_every", "val_set_size": "eval_split"}
_FINETUNE_CHOICES = " or ".join(m.value for m in FINETUNE_METHODS)  # as errors name them
DECAYING = (LRSchedule.LINEAR, LRSchedule.LINEAR.value, LRSchedule.COSINE, LRSchedule.COSINE.value)
RUN_FILE = "run.yaml"  # the resolved configuration, in the run folder


@dataclass(frozen=True)
class FinetuneConfig:
    """A `poros train` run: the training configuration plus data, run folder and schedule.

    Raises:
        ConfigError: listing every invalid field at once.
    """

    train: TrainConfig
    data: Path
    out: Path
    steps: int
    method: Method = Method.POROS
    save_every: int = 100  # 0: only at the end and on Ctrl-C
    eval_data: Path | None = None
    eval_split: float | None = None  # share of the training records held out for the eval loss

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or not 0 < self.steps <= MAX_STEPS:
            problems.append(f"steps: expected an integer > 0, got {self.steps!r:.40} (at most 2**62)")
        if not isinstance(self.save_every, int) or isinstance(self.save_every, bool) or \
                not 0 <= self.save_every <= MAX_STEPS:
            problems.append(f"save_every: expected an integer >= 0 (0: only at the end), got {self.save_every!r:.40}")
        try:
            object.__setattr__(self, "method", Method(self.method))
        except ValueError:
            problems.append(f"method: expected {_FINETUNE_CHOICES}, got {self.method!r}")
        else:
            if not METHODS[self.method].finetune:
                problems.append(f"method: expected {_FINETUNE_CHOICES}, got {self.method.value!r}")
        if self.eval_split is not None:
            s = self.eval_split
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 < s < 0.5:
                problems.append(f"eval_split: expected a share of the records above 0 and below 0.5 (e.g. 0.02), "
                                f"got {s!r:.40}")
            if self.eval_data is not None:
                problems.append(f"eval_split: takes the eval records from the training data, so it goes without "
                                f"eval_data; got both (eval_data {self.eval_data})")
        for name in ("data", "out", "eval_data"):
            v = getattr(self, name)
            if v is None and name == "eval_data":
                continue
            if not isinstance(v, (str, Path)) or not str(v):
                problems.append(f"{name}: expected a path, got {v!r:.60}")
            else:
                object.__setattr__(self, name, Path(v))
        if problems:
            raise ConfigError(problems, source="FinetuneConfig")

    def settings(self) -> dict:
        """config.json's record of the run (paths resolved)."""
        return {"model": str(Path(self.train.model).resolve()), "data": str(self.data.resolve()),
                "eval_data": None if self.eval_data is None else str(self.eval_data.resolve()),
                "eval_split": self.eval_split, "out": str(self.out.resolve()), "steps": self.steps,
                "method": self.method.value, "save_every": self.save_every, "train": self.train.as_dict()}

    def run_file(self) -> dict:
        """The run file that repeats this run: every key a run takes, paths absolute."""
        s = self.settings()
        train = {k: v for k, v in s.pop("train").items() if k in BY_NAME and (BY_NAME[k].cli or k == "gpus")}
        return {**{k: s[k] for k in RUN_KEYS}, **train}


# --- reading the run file and the command line --------------------------------------------------------


def read_run_file(path: str | Path) -> dict:
    """The mapping a run file holds (keys checked by `resolve`).

    Raises:
        ConfigError: the file is missing, not YAML, or not a mapping.
    """
    path = Path(path)
    why = unreadable(path)
    if why:
        raise ConfigError([f"{path} {why}; expected a YAML run file"], "--config")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such run file"], "--config") from None
    except IsADirectoryError:
        raise ConfigError([f"{path} is a folder; expected a YAML run file"], "--config") from None
    except UnicodeDecodeError:
        raise ConfigError([f"{path}: not UTF-8 text; expected a YAML run file"], "--config") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError([f"{where}: not YAML ({getattr(e, 'problem', None) or e})"], "--config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of settings (key: value per line), got "
                           f"{type(data).__name__}"], "--config")
    return data


def parse_overrides(words: list[str]) -> dict:
    """`key=value` words as a mapping, each value read as YAML (`lr=1e-4` a number, `deterministic=true`
    a flag, `lora_targets=[q_proj,v_proj]` a list); dashes in a key read as underscores.

    Raises:
        ConfigError: a word without `=`.
    """
    out, problems = {}, []
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or not key.strip():
            problems.append(f"{w!r}: expected key=value (e.g. lr=1e-4)")
            continue
        try:
            out[key.strip().replace("-", "_")] = load_yaml(value) if value.strip() else None
        except yaml.YAMLError:
            out[key.strip().replace("-", "_")] = value
    if problems:
        raise ConfigError(problems, "poros train")
    return out


def unknown_keys(values: dict, where: str) -> list[str]:
    """A problem for each key that is neither a setting nor a run key, with the nearest known one."""
    problems = []
    for k in values:
        if k in KEYS:
            continue
        near = [OTHER_NAMES[k]] if k in OTHER_NAMES else difflib.get_close_matches(str(k), KEYS, n=1)
        problems.append(f"{where}{k}: not a setting of poros train" + (f" (did you mean {near[0]}?)" if near else
                                                                        f"; known: {', '.join(KEYS)}"))
    return problems


def resolve(values: dict, *, cuda_available: bool) -> tuple[FinetuneConfig, tuple[str, ...]]:
    """The FinetuneConfig of merged run-file, flag and override `values`, with the device's defaults.

    Returns:
        the config, and the names of the settings that took the device's defaults.
    Raises:
        ConfigError: every unknown key, missing key and invalid value at once.
    """
    problems = unknown_keys(values, "")
    missing = [k for k in REQUIRED if values.get(k) is None]
    if missing:
        problems.append(f"missing {', '.join(missing)}: give {'them' if len(missing) > 1 else 'it'} in the run file "
                        f"(--config) or as {', '.join('--' + k for k in missing)}")
    if problems:
        raise ConfigError(problems, "poros train")
    values = dict(values)
    values.setdefault("device", Device.CUDA if cuda_available else Device.CPU)
    settings, chosen = with_defaults({k: v for k, v in values.items() if k in BY_NAME and v is not None})
    values.update(settings)
    if values.get("lr_schedule") in DECAYING and values.get("decay_steps") is None:
        values["decay_steps"] = values["steps"]  # the schedule decays over the run (run.yaml records it)
    run = {k: values.pop(k) for k in RUN_KEYS if values.get(k) is not None}
    model = run.pop("model")
    if not isinstance(model, str) or not model:
        raise ConfigError([f"model: expected a checkpoint folder, got {model!r:.60}"], "poros train")
    problems, train, fc = _warmup_problems(values, run), None, None
    try:
        train = TrainConfig.from_settings({k: v for k, v in values.items() if v is not None}, model=model)
    except ConfigError as e:  # (warm-up past the run's end is said once, above, for every schedule)
        problems += [p for p in e.problems if not (problems and p.startswith("warmup_steps:"))]
    try:  # checked with or without a valid train: every problem at once
        fc = FinetuneConfig(train=train, **run)
    except ConfigError as e:
        problems += e.problems
    if problems:
        raise ConfigError(problems, "poros train")
    return fc, chosen


def _warmup_problems(values: dict, run: dict) -> list[str]:
    """Warm-up that does not end before the run does: the rate never reaches `lr`, on any schedule."""
    warmup, steps = values.get("warmup_steps"), run.get("steps")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (warmup, steps)) and 0 < steps <= warmup:
        return [f"warmup_steps: expected fewer than steps ({steps}), got {warmup}: the run would end before its "
                f"learning rate reaches lr"]
    return []


def dump_run_file(fc: FinetuneConfig) -> str:
    """The run file of `fc` as YAML text, one key a line (each value in JSON, which YAML reads as is)."""
    lines = ["# the resolved configuration of this run: poros train --config run.yaml [--resume] [key=value ...]"]
    lines += [f"{k}: {json.dumps(v.value if isinstance(v, enum.Enum) else v)}" for k, v in fc.run_file().items()]
    return "\n".join(lines) + "\n"


def override_words(fc: FinetuneConfig) -> list[str]:
    """`key=value` words that give every key of `fc`'s run file (what a rank process is started with)."""
    return [f"{k}={json.dumps(v.value if isinstance(v, enum.Enum) else v)}" for k, v in fc.run_file().items()]
