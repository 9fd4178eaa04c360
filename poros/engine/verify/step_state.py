"""What the parity gate compares after one optimizer step of one side (`StepState`): tensors on the device or in
host memory (poros/engine/verify/parity.py), or their digests (poros/engine/verify/parity_digest.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepState:
    """What the gate compares after one optimizer step of one side."""

    losses: list
    grads: dict
    weights: dict
    adamw: dict
