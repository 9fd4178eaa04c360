"""A recorded reference kept as digests: each tensor of the reference's recorded states (`RecordedReference`) by a
hash of its dtype, shape and bytes, a few hundred kilobytes where the states themselves are gigabytes. It lets a gate
run in two parts of a run in parts (`--max-minutes`, then `--resume`): the reference's side in one part, the gated
method's in a later one, on any machine, compared tensor by tensor with the digests.

Equal digests mean equal bytes (a 128-bit hash: two tensors that differ collide with odds of 2^-128), which is
stricter than torch.equal only where the two disagree on signed zeros and NaN payloads: a gate that passes here
passes torch.equal. A mismatch names its tensor, not by how much it differs (`max_abs_diff` is inf): the digest
holds no values."""

from __future__ import annotations

import gzip
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from poros.errors import PorosError

FORMAT = 1
DIGEST_BYTES = 16


@dataclass(frozen=True)
class Digest:
    """A tensor's digest; `value` keeps a loss's value (the gate reports the reference's losses)."""

    hex: str
    value: float | None = None

    def matches(self, t: torch.Tensor | None) -> bool:
        return t is not None and tensor_digest(t) == self.hex

    def __float__(self) -> float:
        if self.value is None:
            raise TypeError("this digest keeps no value")
        return self.value


def tensor_digest(t: torch.Tensor) -> str:
    """blake2b of `t`'s dtype, shape and bytes (any dtype and device)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)  # hashlib lets go of the GIL on large buffers
    return h.hexdigest()


def _digests(tensors: dict, pool: ThreadPoolExecutor) -> dict:
    names = list(tensors)
    hexes = pool.map(lambda n: None if tensors[n] is None else tensor_digest(tensors[n]), names)
    return {n: None if h is None else Digest(h) for n, h in zip(names, hexes)}


@dataclass
class DigestReference:
    """What `run_gate_recorded` needs of a recorded reference (`method`, `init`, `states`), as digests."""

    method: str
    init: dict
    states: list

    @classmethod
    def of(cls, recorded) -> DigestReference:
        """The digests of a `RecordedReference`'s initial weights and recorded steps."""
        from poros.engine.parity import StepState

        with ThreadPoolExecutor() as pool:
            states = [StepState([Digest(tensor_digest(x), float(x)) for x in s.losses], _digests(s.grads, pool),
                                _digests(s.weights, pool), _digests(s.adamw, pool)) for s in recorded.states]
            return cls(str(recorded.method), _digests(recorded.init, pool), states)

    def save(self, path: Path) -> None:
        """Written whole under a temporary name, then renamed: a part killed mid-write leaves no half file."""
        def hexes(d: dict) -> dict:
            return {n: None if v is None else v.hex for n, v in d.items()}

        doc = {"format": FORMAT, "method": self.method, "init": hexes(self.init),
               "states": [{"losses": [[x.hex, x.value] for x in s.losses], "grads": hexes(s.grads),
                           "weights": hexes(s.weights), "adamw": hexes(s.adamw)} for s in self.states]}
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        with gzip.open(part, "wt") as f:
            json.dump(doc, f)
        part.replace(path)

    @classmethod
    def load(cls, path: Path) -> DigestReference:
        """Raises:
            PorosError: the file is unreadable, cut short, or of another format."""
        from poros.engine.parity import StepState

        def digests(d: dict) -> dict:
            return {n: None if h is None else Digest(h) for n, h in d.items()}

        try:
            with gzip.open(path, "rt") as f:
                doc = json.load(f)
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
            states = [StepState([Digest(h, v) for h, v in s["losses"]], digests(s["grads"]), digests(s["weights"]),
                                digests(s["adamw"])) for s in doc["states"]]
            return cls(doc["method"], digests(doc["init"]), states)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            raise PorosError(f"{path}: not a gate reference's digests ({type(e).__name__}: {e}); remove it and "
                             f"run the gate again") from e
