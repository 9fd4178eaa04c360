"""A recorded reference kept as digests: each tensor of the reference's recorded states (`RecordedReference`) by a
hash of its dtype, shape and bytes, a few hundred kilobytes where the states themselves are gigabytes. It lets a gate
run in two parts of a run in parts (`--max-minutes`, then `--resume`): the reference's side in one part, the gated
method's in a later one, on any machine, compared tensor by tensor with the digests.

Equal digests mean equal bytes (a 128-bit hash: two tensors that differ collide with odds of 2^-128), which is
stricter than torch.equal only where the two disagree on signed zeros and NaN payloads: a gate that passes here
passes torch.equal. A mismatch names its tensor, not by how much it differs (`max_abs_diff` is inf): the digest
holds no values.

A file carries the fingerprint of the gate it belongs to and a checksum of everything it holds: one edited by hand
(a digest or a loss changed), damaged, or copied over from another run's gate is refused by name when loaded
(`DigestsRefused`), and the suites record the reference's side again, never blaming the gated method for it."""

from __future__ import annotations

import gzip
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from poros.engine.verify.step_state import StepState
from poros.common.atomic import atomic_path
from poros.errors import PorosError

FORMAT = 2  # 2: the gate's fingerprint and a checksum of the file's contents
DIGEST_BYTES = 16


class DigestsRefused(PorosError):
    """A kept reference's digests that cannot be trusted: unreadable, of another format, not what their checksum
    says, or another gate's."""


def checksum(doc: dict) -> str:
    """sha256 of a digests document's canonical JSON, its `checksum` left out."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
        with ThreadPoolExecutor() as pool:
            states = [StepState([Digest(tensor_digest(x), float(x)) for x in s.losses], _digests(s.grads, pool),
                                _digests(s.weights, pool), _digests(s.adamw, pool)) for s in recorded.states]
            return cls(str(recorded.method), _digests(recorded.init, pool), states)

    def save(self, path: Path, fingerprint: str) -> str:
        """Written whole under a temporary name, then renamed (`poros.common.atomic`): a part killed mid-write leaves
        no half file. `fingerprint`: the gate's (what it runs with), kept in the file.

        Returns:
            The file's checksum (the pass log's `reference` record keeps it too).

        Raises:
            WriteError: the file could not be written (a full disk, a file-size limit)."""
        def hexes(d: dict) -> dict:
            return {n: None if v is None else v.hex for n, v in d.items()}

        doc = {"format": FORMAT, "fingerprint": fingerprint, "method": self.method, "init": hexes(self.init),
               "states": [{"losses": [[x.hex, x.value] for x in s.losses], "grads": hexes(s.grads),
                           "weights": hexes(s.weights), "adamw": hexes(s.adamw)} for s in self.states]}
        doc["checksum"] = checksum(doc)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, "the gate reference's digests", "--resume records them again") as tmp, \
                gzip.open(tmp, "wt") as f:
            json.dump(doc, f)
        return doc["checksum"]

    @classmethod
    def load(cls, path: Path, fingerprint: str, expected_checksum: str | None = None) -> DigestReference:
        """The digests kept in `path` for the gate of `fingerprint`; `expected_checksum`: the one the run recorded
        when it wrote them (the pass log's), where it has one.

        Raises:
            DigestsRefused: the file is unreadable, cut short or of another format, its contents do not match its
                checksum (edited or damaged), or it is another gate's (its fingerprint, or a checksum other than
                the run recorded); naming the file and which."""
        def digests(d: dict) -> dict:
            return {n: None if h is None else Digest(h) for n, h in d.items()}

        try:
            with gzip.open(path, "rt") as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format') if isinstance(doc, dict) else None!r}, expected {FORMAT}")
            states = [StepState([Digest(h, float(v)) for h, v in s["losses"]], digests(s["grads"]),
                                digests(s["weights"]), digests(s["adamw"])) for s in doc["states"]]
            kept = cls(doc["method"], digests(doc["init"]), states)
        except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DigestsRefused(f"{path}: not a gate reference's digests ({type(e).__name__}: {e})") from e
        if doc.get("checksum") != checksum(doc):
            raise DigestsRefused(f"{path}: its contents do not match its checksum (the file was edited or damaged)")
        if doc.get("fingerprint") != fingerprint:
            raise DigestsRefused(f"{path}: holds the digests of another gate (fingerprint {doc.get('fingerprint')}, "
                                 f"this gate's is {fingerprint}): another run's file")
        if expected_checksum is not None and doc["checksum"] != expected_checksum:
            raise DigestsRefused(f"{path}: is not the file this run recorded (checksum {doc['checksum'][:12]}, the "
                                 f"pass log's {expected_checksum[:12]}): another run's file")
        return kept
