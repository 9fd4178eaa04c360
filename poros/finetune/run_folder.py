"""The run folder of `poros train`. A new run takes a new or empty folder; `--resume` takes one that holds a
run (its config.json and checkpoint/) and refuses every change that would change what a step computes: a setting
of `EXACT_FIELDS`, the eval split, or other model or data content than the run's fingerprints name, so the resumed
run ends torch.equal to an uninterrupted one. A run holds the folder's lock while it runs (`own_run_folder`) and
writes its records whole or not at all (`poros.common.atomic.write_atomic`).
"""

from __future__ import annotations

import contextlib
import enum
import json
import sys
from pathlib import Path

from poros.common.folders import LOCK_NAME, OutputInUse, OutputLock
from poros.config import BY_NAME, COMPUTED_NAMES
from poros.engine.parallel.distributed import any_rank
from poros.errors import CheckpointError, ConfigError, PorosError
from poros.finetune.checkpoint import check_checkpoint, recover_checkpoint

# settings that change what a step computes (--seed also draws the LoRA init and the data order);
# --resume refuses a change to any of them and accepts new schedule settings
EXACT_FIELDS = (*COMPUTED_NAMES, "seed", "device")


def prepare_out(out: Path, resume: bool, steps: int) -> dict | None:
    """Check the run folder; on resume return its config.json (settings of the run so far) with the
    checkpoint's state.json under "checkpoint"."""
    if not resume:
        if out.exists() and (not out.is_dir() or any(p.name != LOCK_NAME for p in out.iterdir())):
            if (out / "config.json").is_file():
                raise ConfigError([f"{out} holds another run (config.json, checkpoint/); pass --resume to continue "
                                   "it or choose another --out"], "--out")
            raise ConfigError([f"{out} is not an empty folder; choose a new or empty --out"], "--out")
        return None
    if not (out / "config.json").is_file():
        raise ConfigError([f"{out} holds no run (no config.json); leave out --resume to start one"], "--resume")
    recover_checkpoint(out)
    if not (out / "checkpoint").is_dir():
        raise ConfigError([f"{out} has no checkpoint (checkpoint/state.json) to continue from; start again in a "
                           "new --out"], "--resume")
    before = _run_record(out / "config.json")
    before["checkpoint"] = check_checkpoint(out)
    if steps <= before["checkpoint"]["step"]:
        raise ConfigError([f"the run in {out} is already at step {before['checkpoint']['step']}, got --steps "
                           f"{steps}; raise --steps to train further"], "--steps")
    return before


def _run_record(path: Path) -> dict:
    """A run folder's config.json, as --resume reads it (its settings and fingerprints).

    Raises:
        CheckpointError: a record that is not one (the run cannot be checked, so it is not continued).
    """
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        record, why = None, f"not readable JSON ({str(e).splitlines()[0][:80]})"
    else:
        why = "expected the run's settings and fingerprints"
    ok = isinstance(record, dict) and isinstance(record.get("settings"), dict) and \
        isinstance(record["settings"].get("train"), dict) and isinstance(record.get("fingerprints"), dict)
    if not ok:
        raise CheckpointError(f"{path}: {why}; the run's settings cannot be checked, so it cannot resume: start "
                              f"again in a new --out ({path.parent} is left as it is)")
    return record


def _as_recorded(value):
    """A setting's value as config.json records it (TrainConfig.as_dict)."""
    return value.value if isinstance(value, enum.Enum) else list(value) if isinstance(value, tuple) else value


def check_resume(before: dict, now: dict) -> None:
    """Name every setting whose change would break exactness."""
    diffs = []
    for k in EXACT_FIELDS:  # a setting newer than the run reads as its default
        a = before["settings"]["train"].get(k, _as_recorded(BY_NAME[k].default) if k in BY_NAME else None)
        b = now["settings"]["train"].get(k)
        if a != b:
            diffs.append(f"{k} {a} (now {b})")
    a, b = before["settings"].get("eval_split"), now["settings"]["eval_split"]
    if a != b:  # which records train and which are held out
        diffs.append(f"eval_split {a} (now {b})")
    for k in ("model", "data"):
        a, b = before["fingerprints"].get(k), now["fingerprints"][k]
        if a != b:
            diffs.append(f"{k} {now['settings'][k]} (other content than the run's: sha256 {b[:12]}, was {a[:12]})")
    a, b = before["fingerprints"].get("weights"), now["fingerprints"]["weights"]
    if a is not None and a != b and before["fingerprints"].get("model") == now["fingerprints"]["model"]:
        diffs.append(f"model {now['settings']['model']} (other weights than the run's base, in files of the same "
                     f"names and sizes: sampled sha256 {b[:12]}, was {a[:12]})")
    if diffs:
        raise ConfigError([f"settings differ from the run in {now['settings']['out']} and would change its result: "
                           f"{', '.join(diffs)}; use the run's settings (its run.yaml: poros train --config "
                           f"{now['settings']['out']}/run.yaml --resume) or a new --out"], "--resume")


@contextlib.contextmanager
def own_run_folder(out: Path, world):
    """Hold the run folder's lock (poros.common.folders.OutputLock, rank 0) for the run; a folder
    the run created and left empty (a refused run) is removed again."""
    created = not out.exists()
    lock, problem = None, None
    if world.main:
        lock = OutputLock(out)
        try:
            lock.acquire()
        except OutputInUse as e:
            problem = OutputInUse(str(e).replace("pass another -o", "pass another --out"))
        except PorosError as e:
            problem = e
    if any_rank(problem is not None, world):
        raise problem or PorosError(f"rank 0 cannot take the run folder {out}")
    try:
        if lock is not None and lock.stale_warning():
            print(lock.stale_warning(), file=sys.stderr, flush=True)
        yield
    finally:
        if lock is not None:
            lock.release()
            if created and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
