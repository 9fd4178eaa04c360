"""LoRA dropout whose masks are keyed, not drawn from the global random state.

peft's LoRA dropout is an `nn.Dropout`: each call draws a fresh mask from the global generator. Poros
runs a layer's forward twice (without autograd, then again in backward) and resident QLoRA once, so
masks drawn that way differ between the two runs and between a forward and its recompute. A
`KeyedDropout` draws its mask from a generator seeded by (seed, optimizer step, micro-batch, module):
every call with the same keys draws the same mask, on whatever schedule the call comes.

Where a recompute runs inside a backward (`mlp_chunk`'s checkpointed chunks), on poros's backward thread while
its own thread moves the keys on, the chunk pins the keys it first ran under (`DropoutKeys.pinned`): for the
thread that runs it, until it returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading

import torch
from torch import nn


class DropoutKeys:
    """The keys of the masks drawn now, shared by every `KeyedDropout` of a model; the trainer moves
    `step` and `micro` (the micro-batch's index among the step's, over every data-parallel rank)."""

    def __init__(self, seed: int):
        self.seed, self.step, self.micro = seed, 0, 0
        self.enabled = True  # off: identity (an eval pass)

    def generator_seed(self, module: int) -> int:
        pin = getattr(_PINNED, "keys", None)
        if pin is not None and pin[0] is self:
            _, step, micro, chunk = pin
            text = f"poros-lora-dropout:{self.seed}:{step}:{micro}:{module}:chunk{chunk}"
        else:
            text = f"poros-lora-dropout:{self.seed}:{self.step}:{self.micro}:{module}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    @contextlib.contextmanager
    def pinned(self, step: int, micro: int, chunk: int):
        """While inside, on this thread, masks are drawn under `step` and `micro` (not the keys' current ones)
        and chunk `chunk` of a module's input (each chunk its own masks)."""
        before = getattr(_PINNED, "keys", None)
        _PINNED.keys = (self, step, micro, chunk)
        try:
            yield
        finally:
            _PINNED.keys = before


_PINNED = threading.local()  # (keys, step, micro, chunk) pinned on this thread (`DropoutKeys.pinned`)


class KeyedDropout(nn.Module):
    """Inverted dropout with share `p`, its mask a function of `keys` and this module's `index`."""

    def __init__(self, p: float, keys: DropoutKeys, index: int):
        super().__init__()
        self.p, self.keys, self.index = p, keys, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.keys.enabled):
            return x
        gen = torch.Generator(device=x.device)
        gen.manual_seed(self.keys.generator_seed(self.index))
        keep = torch.rand(x.shape, generator=gen, device=x.device) >= self.p
        return x * keep * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, module={self.index}"


def key_lora_dropout(model: nn.Module, p: float, keys: DropoutKeys) -> int:
    """Replace the LoRA dropout modules of a peft model with `KeyedDropout`s, numbered in module order
    (the same for every method: the same model); returns how many."""
    n = 0
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if not isinstance(drops, nn.ModuleDict):
            continue
        for name in list(drops.keys()):
            drops[name] = KeyedDropout(p, keys, n)
            n += 1
    return n
