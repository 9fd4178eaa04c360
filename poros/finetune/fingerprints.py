"""A base checkpoint by content, as a run records it (config.json's `fingerprints`): `--resume` refuses a
base that changed, and `poros export` / `poros generate` refuse an adapter trained on another base."""

from __future__ import annotations

import hashlib
from pathlib import Path

from poros.finetune.tokenizing import TOKENIZER_META

WEIGHT_SAMPLES = 64  # windows of each weight file read for the base's fingerprint
WEIGHT_WINDOW = 1 << 16


def weights_fingerprint(folder: Path) -> str:
    """The weight files by content, sampled: each file's safetensors header and WEIGHT_SAMPLES windows
    spread over its data (a few MB read for any size). Two checkpoints of the same shapes differ here."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head + fh.read(min(n, 1 << 24)))
            for k in range(WEIGHT_SAMPLES):
                fh.seek(size * k // WEIGHT_SAMPLES)
                h.update(fh.read(WEIGHT_WINDOW))
    return h.hexdigest()


def model_fingerprint(folder: Path) -> str:
    """config.json and tokenizer files by content, weight files by name and size (cheap for 60 GB)."""
    h = hashlib.sha256()
    for name in ("config.json", *TOKENIZER_META):
        if (folder / name).is_file():
            h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}\0{f.stat().st_size}".encode())
    return h.hexdigest()
