"""Unsloth as a third method (GPU only): FastLanguageModel with 4-bit weights and LoRA."""

from __future__ import annotations

import importlib.util

from poros.errors import CapabilityError


def unavailable(device: str) -> str | None:
    """Why Unsloth cannot run here (None when it can). Declared, not discovered by trying."""
    if device != "cuda":
        return "unsloth needs a CUDA GPU (it cannot even be imported without one)"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (pip install 'poros[unsloth]')"
    return None


class UnslothTrainer:  # replaced below once implemented
    def __init__(self, store, cfg):
        why = unavailable(cfg.device.value)
        raise CapabilityError(why or "unsloth method not available")
