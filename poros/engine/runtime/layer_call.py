"""One decoder layer's call: the arguments a prologue recorded for it, and the one place the engine calls a
layer with them (eagerly, or inside a layer template)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LayerCall:
    """A layer's call arguments other than its hidden state, and whether that state goes by keyword."""

    args: tuple
    kwargs: dict
    kw_hidden: bool

    @classmethod
    def split(cls, args: tuple, kwargs: dict) -> tuple[torch.Tensor, "LayerCall"]:
        """(hidden state, the rest) of a call as the Hugging Face model makes it."""
        if "hidden_states" in kwargs:
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            return kwargs["hidden_states"], cls(args, rest, True)
        return args[0], cls(args[1:], kwargs, False)

    def tensors_requiring_grad(self) -> bool:
        return any(torch.is_tensor(t) and t.requires_grad for t in (*self.args, *self.kwargs.values()))

    def __call__(self, layer: nn.Module, hidden: torch.Tensor):
        """`layer` on `hidden` with these arguments: what the layer returns."""
        if self.kw_hidden:
            return layer(*self.args, hidden_states=hidden, **self.kwargs)
        return layer(hidden, *self.args, **self.kwargs)


def hidden_of(out) -> torch.Tensor:
    """The hidden state a layer returns (alone, or first of a tuple)."""
    return out[0] if isinstance(out, tuple) else out
