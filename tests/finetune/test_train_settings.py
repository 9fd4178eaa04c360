"""`poros train` with the shared training settings: flags from the settings table, decay over --steps,
run.yaml records them, poros ends equal to resident, a resume continues exactly and refuses a change."""

from __future__ import annotations

import csv
import math

import yaml

from poros.finetune.config import resolve
from tests.finetune.test_recipe import _refused, files, run_state, train  # noqa: F401  (files: a fixture)
from tests.store.test_build import assert_all_equal

SETTINGS = ["--lr-schedule", "cosine", "--warmup-steps", "1", "--weight-decay", "0.1", "--max-grad-norm", "0.5",
            "--lora-dropout", "0.1"]


def test_decay_steps_default_to_the_runs_steps():
    base = {"model": "m", "data": "d.jsonl", "out": "o", "steps": 30}
    fc, _ = resolve({**base, "lr_schedule": "cosine"}, cuda_available=False)
    assert fc.train.decay_steps == 30
    fc, _ = resolve({**base, "lr_schedule": "linear", "decay_steps": 20}, cuda_available=False)
    assert fc.train.decay_steps == 20
    fc, _ = resolve(base, cuda_available=False)
    assert fc.train.decay_steps is None


def test_lora_dropout_keeps_cuda_graphs_off_by_default():
    base = {"model": "m", "data": "d.jsonl", "out": "o", "steps": 3, "device": "cuda"}
    fc, chosen = resolve({**base, "lora_dropout": 0.1}, cuda_available=True)
    assert fc.train.cuda_graphs is False and "cuda_graphs" not in chosen
    fc, chosen = resolve(base, cuda_available=True)
    assert fc.train.cuda_graphs is True


def test_keep_attention_keeps_cuda_graphs_off_by_default():
    base = {"model": "m", "data": "d.jsonl", "out": "o", "steps": 3, "device": "cuda"}
    fc, chosen = resolve({**base, "keep_attention": True}, cuda_available=True)
    assert fc.train.cuda_graphs is False and fc.train.keep_attention is True and "cuda_graphs" not in chosen
    assert {"attention", "deterministic", "vram_budget"} <= set(chosen)


def test_a_run_with_every_setting(files, tmp_path, capsys):  # noqa: F811
    poros, resident = tmp_path / "poros", tmp_path / "resident"
    assert train(files, poros, *SETTINGS) == 0
    assert train(files, resident, *SETTINGS, "--method", "resident") == 0
    assert_all_equal("poros vs resident", run_state(resident), run_state(poros))

    run = yaml.safe_load((poros / "run.yaml").read_text())
    assert {k: run[k] for k in ("lr_schedule", "warmup_steps", "decay_steps", "weight_decay", "max_grad_norm",
                                "lora_dropout")} == dict(lr_schedule="cosine", warmup_steps=1, decay_steps=4,
                                                         weight_decay=0.1, max_grad_norm=0.5, lora_dropout=0.1)
    with (poros / "log.csv").open(newline="") as f:
        rates = [float(r["lr"]) for r in csv.DictReader(f)]
    assert rates == [0.0, 3e-3, 3e-3 * 0.5 * (1 + math.cos(math.pi / 3)), 3e-3 * 0.5 * (1 + math.cos(2 * math.pi / 3))]

    # resumed at step 2 it ends as the uninterrupted run
    part = tmp_path / "part"
    assert train(files, part, *SETTINGS, "decay_steps=4", steps=2) == 0
    assert train(files, part, "--config", str(part / "run.yaml"), "--resume") == 0  # decay_steps 4 from run.yaml
    assert_all_equal("resumed at 2 vs uninterrupted", run_state(poros), run_state(part))

    # a changed setting, or a longer run (another decay), is refused by name
    capsys.readouterr()
    code = train(files, poros, *SETTINGS, "--resume", "--weight-decay", "0.2", "--lora-dropout", "0.2", steps=6)
    _refused(capsys, code, "--resume: settings differ", "weight_decay 0.1 (now 0.2)", "lora_dropout 0.1 (now 0.2)",
             "decay_steps 4 (now 6)")
