"""Layer-by-layer progress of a build or load, and what it reports when done."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable


class LayerProgress:
    """`\rWHAT: layer i/n` on stderr (a terminal by default) and `on_layer(i, n)`, layer by layer."""

    def __init__(self, what: str, n: int, show: bool | None, on_layer: Callable[[int, int], None] | None = None):
        self.what, self.n, self.on_layer = what, n, on_layer
        self.show = sys.stderr.isatty() if show is None else show

    def __call__(self, i: int) -> None:
        if self.on_layer:
            self.on_layer(i, self.n)
        if self.show:
            print(f"\r{self.what}: layer {i}/{self.n}", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.show:
            print(file=sys.stderr)


@dataclass
class BuildStats:
    seconds: float
    store_bytes: int
    layers: int
    device: str
    peak_device_bytes: int | None
