"""Training settings every method shares (lr_schedule, warmup_steps, decay_steps, weight_decay, max_grad_norm,
lora_dropout): poros and resident stay torch.equal under each, and a side that differs in one FAILs the gate."""

from __future__ import annotations

import math

import pytest
import torch

from poros.config import Method, TrainConfig
from poros.engine.model.dropout import DropoutKeys, KeyedDropout
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import parity
from poros.engine.methods.schedule import learning_rate, lr_factor
from poros.errors import ConfigError
from poros.choices import LRSchedule
from tests.capabilities import requires_bitsandbytes

pytestmark = requires_bitsandbytes

DEFAULT_TIER = ["tiny-qwen2", "tiny-gemma3"]
MODELS = [*DEFAULT_TIER, *(pytest.param(m, marks=pytest.mark.slow) for m in ("tiny-qwen3", "tiny-gemma4"))]
STEPS = 3
# each case with a value that moves every step's update away from the default's
CASES = {
    "cosine": dict(lr_schedule="cosine", warmup_steps=1, decay_steps=4),
    "linear": dict(lr_schedule="linear", warmup_steps=2, decay_steps=4),
    "weight_decay": dict(weight_decay=0.5),
    "max_grad_norm": dict(max_grad_norm=1e-3),
    "lora_dropout": dict(lora_dropout=0.3),
}


def config(model: str, **settings) -> TrainConfig:
    return TrainConfig(model=model, seq_len=64, block_size=2, grad_accum=2, lr=1e-2, **settings)


def assert_pass(result) -> None:
    assert result.ok, f"first mismatch {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"
    assert result.steps == STEPS and result.max_abs_diff == 0.0


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"setting={c}")
@pytest.mark.parametrize("model", MODELS, ids=lambda m: f"model={m}")
def test_poros_equals_resident(stores, model, case):
    """Losses, gradients, LoRA weights and AdamW state torch.equal over 3 steps."""
    assert_pass(parity(config(model, **CASES[case]), steps=STEPS, store=stores(model)))


def test_every_setting_at_once_with_a_kept_layer_and_micro_order(stores):
    cfg = config("tiny-qwen2", **CASES["cosine"], weight_decay=0.1, max_grad_norm=0.01, lora_dropout=0.2,
                 accumulation="micro", overlap_backward=False)
    assert_pass(parity(cfg, steps=STEPS, store=stores("tiny-qwen2")))


def test_resident_gc_equals_resident_with_dropout(stores):
    """Hugging Face's checkpointing recomputes each layer in backward, as poros does: the same masks again."""
    cfg = config("tiny-gemma3", lora_dropout=0.3, max_grad_norm=1e-3)
    assert_pass(parity(cfg, steps=STEPS, store=stores("tiny-gemma3"), method=Method.RESIDENT_GC))


# --- negative controls: the gate sees a side that differs in one setting ---------------------------------


def _poros_with(**changes):
    def mutate(resident, poros):
        poros.cfg = poros.cfg.replace(**changes)
        for group in poros.optimizer.param_groups:
            group["weight_decay"] = poros.cfg.weight_decay

    return mutate


@pytest.mark.parametrize("case,changes", [
    ("cosine", dict(lr_schedule="linear")),
    ("cosine", dict(warmup_steps=0)),
    ("cosine", dict(decay_steps=5)),
    ("linear", dict(warmup_steps=1)),
    ("weight_decay", dict(weight_decay=0.25)),
    ("max_grad_norm", dict(max_grad_norm=2e-3)),
    ("max_grad_norm", dict(max_grad_norm=None)),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else f"setting={v}")
def test_a_poros_side_with_another_value_fails(stores, case, changes):
    result = parity(config("tiny-qwen2", **CASES[case]), steps=STEPS, store=stores("tiny-qwen2"),
                    mutate=_poros_with(**changes))
    assert result.parity == "FAIL" and result.first_mismatch is not None, changes
    assert result.first_mismatch.startswith("step"), result.first_mismatch


def _global_rng_dropout(*trainers):
    """peft's own dropout (masks from the global generator) in place of the keyed one."""
    for t in trainers:
        for module in t.model.modules():
            drops = getattr(module, "lora_dropout", None)
            if isinstance(drops, torch.nn.ModuleDict):
                for name in list(drops.keys()):
                    assert isinstance(drops[name], KeyedDropout)
                    drops[name] = torch.nn.Dropout(drops[name].p)


def test_dropout_from_the_global_generator_fails(stores):
    """Poros's recompute draws a second mask from the global generator, so its gradients are not resident's."""
    torch.manual_seed(0)
    result = parity(config("tiny-qwen2", lora_dropout=0.3), steps=STEPS, store=stores("tiny-qwen2"),
                    mutate=lambda r, p: _global_rng_dropout(r, p))
    assert result.parity == "FAIL" and ".grad:" in result.first_mismatch, result.first_mismatch


def test_dropout_keyed_without_the_micro_batch_fails(stores, monkeypatch):
    """The micro-batch is part of the key: a poros side that ignores it draws other masks."""

    def mutate(resident, poros):
        poros.dropout_micro = lambda k, per_rank: None

    result = parity(config("tiny-qwen2", lora_dropout=0.3), steps=STEPS, store=stores("tiny-qwen2"), mutate=mutate)
    assert result.parity == "FAIL", result.first_mismatch


# --- what each setting does -------------------------------------------------------------------------------


def test_the_schedule_follows_its_formula():
    """Warm-up lr x s / W, then half a cosine to 0 at decay_steps, and 0 after."""
    w, t = 3, 11
    factors = [lr_factor(LRSchedule.COSINE, s, w, t) for s in range(14)]
    assert factors[:4] == [0.0, 1 / 3, 2 / 3, 1.0]
    for s in range(w, t):
        assert factors[s] == 0.5 * (1 + math.cos(math.pi * (s - w) / (t - w)))
    assert factors[7] == pytest.approx(0.5) and factors[t:] == [0.0, 0.0, 0.0]
    assert [lr_factor(LRSchedule.LINEAR, s, 2, 6) for s in range(8)] == [0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0]
    assert [lr_factor(LRSchedule.CONSTANT, s, 2, None) for s in range(4)] == [0, 0.5, 1, 1]


def test_the_trainer_steps_with_the_schedules_rates(stores):
    cfg = config("tiny-qwen2", lr_schedule="cosine", warmup_steps=1, decay_steps=4)
    trainer = make_trainer(Method.RESIDENT, stores("tiny-qwen2"), cfg)
    seen = []
    real = trainer.optimizer.step
    trainer.optimizer.step = lambda: (seen.append(trainer.optimizer.param_groups[0]["lr"]), real())
    for _ in range(4):
        trainer.step()
    trainer.close()
    assert seen == [0.0, 1e-2, 1e-2 * 0.5 * (1 + math.cos(math.pi / 3)), 1e-2 * 0.5 * (1 + math.cos(2 * math.pi / 3))]
    assert seen == [learning_rate(cfg, s) for s in range(4)]


def _one_step(store, **settings):
    trainer = make_trainer(Method.RESIDENT, store, config("tiny-qwen2", **settings))
    trainer.accumulate_step(trainer.batches(0))
    grads = {n: g.clone() for n, g in trainer.lora_grads().items()}
    norm = trainer.clip_gradients()
    clipped = {n: p.grad.clone() for n, p in trainer.params}
    trainer.clip_gradients = lambda: None  # clipped already
    trainer.optimizer_step()
    weights = {n: w.clone() for n, w in trainer.lora_state().items()}
    trainer.close()
    return grads, norm, clipped, weights


def test_clipping_clips(stores):
    """A norm far below the gradients' scales them to it, and the update changes; the accumulated
    gradients (what the gate compares) stay as they were."""
    store = stores("tiny-qwen2")
    grads, none, same, free = _one_step(store)
    assert none is None and all(torch.equal(grads[n], same[n]) for n in grads)
    grads2, norm, clipped, weights = _one_step(store, max_grad_norm=1e-4)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert float(norm) > 1e-3
    after = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped.values()]))
    assert float(after) == pytest.approx(1e-4, rel=1e-3)
    assert any(not torch.equal(free[n], weights[n]) for n in free)
    # a norm above the gradients' leaves them as they are
    _, _, loose, _ = _one_step(store, max_grad_norm=1e6)
    assert all(torch.equal(grads[n], loose[n]) for n in grads)


def test_weight_decay_reaches_adamw(stores):
    trainer = make_trainer(Method.RESIDENT, stores("tiny-qwen2"), config("tiny-qwen2", weight_decay=0.25))
    assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.25]
    trainer.close()


def test_keyed_dropout_masks():
    keys = DropoutKeys(seed=5)
    drop = KeyedDropout(0.5, keys, index=3).train()
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    a, b = drop(x), drop(x)
    assert torch.equal(a, b)  # the same keys: the same mask, call after call
    assert set(a.unique().tolist()) == {0.0, 2.0}
    assert 0.3 < float((a == 0).float().mean()) < 0.7
    keys.micro = 1
    assert not torch.equal(drop(x), a)
    keys.micro, keys.step = 0, 1
    assert not torch.equal(drop(x), a)
    keys.step = 0
    assert not torch.equal(KeyedDropout(0.5, keys, index=4).train()(x), a)
    assert torch.equal(drop(x), a)
    keys.enabled = False
    assert drop(x) is x


def test_lora_dropout_replaces_every_lora_dropout_module(stores):
    trainer = make_trainer(Method.POROS, stores("tiny-qwen2"), config("tiny-qwen2", lora_dropout=0.1))
    drops = [m for m in trainer.model.modules() if isinstance(m, KeyedDropout)]
    loras = [m for m in trainer.model.modules() if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict)]
    assert len(drops) == len(loras) == 5 * 7 and sorted(d.index for d in drops) == list(range(35))
    assert not any(type(m) is torch.nn.Dropout for m in trainer.model.modules() if m not in drops)
    trainer.close()


# --- validation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings,named", [
    (dict(lr_schedule="step"), "lr_schedule: expected one of constant, linear, cosine"),
    (dict(warmup_steps=-1), "warmup_steps: expected an integer >= 0"),
    (dict(weight_decay=-0.1), "weight_decay: expected a finite number >= 0"),
    (dict(weight_decay=float("nan")), "weight_decay:"),
    (dict(max_grad_norm=0), "max_grad_norm: expected a finite number > 0 or none"),
    (dict(max_grad_norm="big"), "max_grad_norm: expected a number > 0 or none"),
    (dict(lora_dropout=1.0), "lora_dropout: expected a number from 0 up to (not including) 1"),
    (dict(lora_dropout=True), "lora_dropout:"),
    (dict(lr_schedule="cosine"), "decay_steps: lr_schedule cosine decays to 0 at decay_steps; give it"),
    (dict(decay_steps=10), "decay_steps: only linear and cosine decay"),
    (dict(lr_schedule="linear", warmup_steps=10, decay_steps=10), "warmup_steps: expected fewer than decay_steps"),
    (dict(lora_dropout=0.1, cuda_graphs=True, device="cuda"), "lora_dropout: its masks are drawn per call"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_bad_values_are_refused_naming_the_setting(settings, named):
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen2", **settings)
    assert named in str(e.value), str(e.value)


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="tiny-qwen2", warmup_steps=-1, weight_decay=-1, lora_dropout=2)
    assert len(e.value.problems) == 3


def test_flags_come_from_the_settings_table():
    import argparse

    from poros.cli.flags import add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--lr-schedule", "cosine", "--warmup-steps", "5", "--decay-steps", "100",
                              "--weight-decay", "0.01", "--max-grad-norm", "1.0", "--lora-dropout", "0.05"])
    cfg = TrainConfig.from_settings(from_arguments(args), model="tiny-qwen2")
    assert (cfg.lr_schedule, cfg.warmup_steps, cfg.decay_steps, cfg.weight_decay, cfg.max_grad_norm,
            cfg.lora_dropout) == (LRSchedule.COSINE, 5, 100, 0.01, 1.0, 0.05)
