"""The learning rate of each optimizer step, a function of the settings and the step alone.

Every method sets its AdamW learning rate from `learning_rate(cfg, step)` before each optimizer step
(poros/engine/methods/trainer.py), so a resumed run needs no scheduler state: the step count is enough. The
formulas are those of Hugging Face's `get_{constant,linear,cosine}_schedule_with_warmup`, so a run
moved from Transformers or TRL keeps its curve; past `decay_steps` the rate stays 0 (where the
Transformers cosine would rise again).
"""

from __future__ import annotations

import math

from poros.choices import LRSchedule


def lr_factor(schedule: LRSchedule, step: int, warmup_steps: int, decay_steps: int | None) -> float:
    """The share of the peak learning rate that optimizer step `step` (0 for the first) takes."""
    if step < warmup_steps:
        return step / warmup_steps
    if schedule is LRSchedule.CONSTANT:
        return 1.0
    if step >= decay_steps:
        return 0.0
    span = decay_steps - warmup_steps
    if schedule is LRSchedule.LINEAR:
        return (decay_steps - step) / span
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / span))


def learning_rate(cfg, step: int) -> float:
    """AdamW's learning rate at optimizer step `step` of a run with settings `cfg` (a TrainConfig)."""
    return cfg.lr * lr_factor(cfg.lr_schedule, step, cfg.warmup_steps, cfg.decay_steps)
