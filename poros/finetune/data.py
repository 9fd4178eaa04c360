"""Text data for `poros train`: JSON Lines records (poros.finetune.records) or a table's rows
(poros.finetune.tables), tokenized with the checkpoint's own tokenizer, packed into blocks of
seq_len tokens and visited in a seeded order that depends only on the position.

A `{"text": ...}` record learns every token; a `{"prompt": ..., "completion": ...}` record learns
the completion (and the end-of-sequence token after it) only; a `{"messages": [...]}` record is
rendered with the tokenizer's chat template and learns the assistant turns only (labels -100
elsewhere). With an eval split, each record is held out or trained on by a hash of (seed, its
ordinal): the choice depends on nothing else, so it is the same on every run and resume. Records are
concatenated in file order and cut into blocks; the tail shorter than a block is dropped, and so is a
block with no token to learn (both are counted in what the run prints). Sequence g of the run is
block `order(g // n)[g % n]`, one seeded permutation per pass over the n blocks, so a run resumed
at position g sees exactly the batches it would have.

Tokenization streams: records are read and tokenized a chunk at a time into two files (token ids as
int32, and whether each token is learned) that are then memory-mapped, so host memory stays bounded
whatever the file's size. The files are a cache beside the data (`.poros-cache/`), keyed by the data
file's sha256, the tokenizer files, the eval split and the tokenization format, so a resumed run (or another run on
the same data and tokenizer) reads them instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from poros.common.atomic import NO_ROOM, write_failure
from poros.engine.methods.data import Batch
from poros.finetune.records import DataError, LineReader, RecordCounts, read_records, records  # noqa: F401
from poros.finetune import tokenizing
from poros.finetune.tables import open_reader
from poros.finetune.tokenizing import IGNORE

ORDER_SEED_STRIDE = 1_000_003
CACHE_DIR = ".poros-cache"
CACHE_FORMAT = 2  # bump when what the cached files hold for the same data and tokenizer changes
CHUNK_CHARS = 1 << 20  # records are tokenized in chunks of about this many characters
PROGRESS_SECONDS = 5.0  # a progress line at most this often while tokenizing


@dataclass
class TokenStream:
    """A data file's tokens, memory-mapped from the cache: ids (int32) and whether each is learned."""

    ids: np.ndarray
    learn: np.ndarray
    counts: RecordCounts
    learned: int  # tokens learned
    max_id: int
    cached: bool  # read from an earlier run's cache, not tokenized now
    folder: Path
    held_out: "TokenStream | None" = None  # the records an eval split holds out

    @property
    def tokens(self) -> int:
        return len(self.ids)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


HELD_OUT = "eval"  # the cache's subfolder of the records an eval split holds out


def held_out(seed: int, ordinal: int, share: float) -> bool:
    """Whether record `ordinal` (from 0, in file order) is held out by an eval split of `share`."""
    h = hashlib.blake2b(f"{seed}:{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") < share * 2**64


def tokenize(path: str | Path, tok, *, data_sha256: str, tokenizer_id: str, cache_root: Path | None = None,
             say: Callable[[str], None] = lambda s: None, eval_split: float | None = None,
             seed: int = 0) -> TokenStream:
    """The token stream of a data file: from the cache when an earlier run made it, else tokenized a
    chunk at a time into the cache (host memory bounded by the chunk), with a progress line at most
    every PROGRESS_SECONDS. With `eval_split`, the records it holds out (`held_out`) are in the
    stream's `held_out` stream instead.

    Args:
        cache_root: where the cache lives (default: `.poros-cache/` beside the data file).
    Raises:
        DataError: a bad record (naming file and line), or a cache folder that cannot be written.
    """
    path = Path(path)
    split = (eval_split, seed) if eval_split else None
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, data_sha256, tokenizer_id, tokenizing.PIECE_CHARS, split]).encode()).hexdigest()
    root = cache_root or path.parent / CACHE_DIR
    folder = root / f"{path.name}.{key[:20]}"
    hit = _open_cache(folder, split)
    if hit is not None:
        return hit
    reader = open_reader(path)  # a missing file or library is named before any folder is made
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(_mkdtemp(root, folder.name))
    except OSError as e:
        raise DataError(f"{root}: cannot write the token cache there ({e.strerror})") from None
    try:
        try:
            _tokenize_into(tmp, path, reader, tok, say, split)
        except OSError as e:
            if e.errno not in NO_ROOM:  # reading the data failed, not writing the cache
                raise
            raise write_failure("the token cache", folder, e, "nothing of it is kept") from None
        try:
            os.rename(tmp, folder)
        except OSError:  # another rank or run made the same cache meanwhile: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stream = _open_cache(folder, split)
    if stream is None:
        raise DataError(f"{folder}: the token cache just written cannot be read back; delete {root} and run again")
    stream.cached = False
    if stream.held_out is not None:
        stream.held_out.cached = False
    return stream


def _mkdtemp(root: Path, name: str) -> str:
    import tempfile

    return tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=root)


class _Part:
    """One token stream being written: its files, the records waiting in a chunk, and its counts."""

    def __init__(self, folder: Path):
        folder.mkdir(exist_ok=True)
        self.folder = folder
        self.fi, self.fl = (folder / "ids.i32").open("wb"), (folder / "learn.u8").open("wb")
        self.counts = RecordCounts()
        self.tokens = self.learned = self.top = 0
        self.chunk: list[dict] = []
        self.lines: list[int] = []

    def add(self, n: int, rec: dict) -> None:
        kind = "completion" if "prompt" in rec else "text" if "text" in rec else "chat"
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        self.chunk.append(rec)
        self.lines.append(n)

    def flush(self, tok, source: str) -> None:
        if not self.chunk:
            return
        ids, labels = tokenizing.encode_records(tok, self.chunk, source, self.lines)
        a = np.asarray(ids, dtype=np.int64)
        m = np.asarray(labels, dtype=np.int64) != IGNORE
        if a.size:
            self.top = max(self.top, int(a.max()))
        a.astype(np.int32).tofile(self.fi)
        m.astype(np.uint8).tofile(self.fl)
        self.tokens, self.learned = self.tokens + a.size, self.learned + int(m.sum())
        self.chunk.clear()
        self.lines.clear()

    def close(self, source: Path, mapped) -> None:
        self.fi.close()
        self.fl.close()
        c = self.counts
        meta = {"format": CACHE_FORMAT, "source": str(source), "tokens": self.tokens, "learned": self.learned,
                "max_id": self.top, "text": c.text, "chat": c.chat, "completion": c.completion,
                "mapped": [[a, b, n] for (a, b), n in sorted(mapped.items())]}
        (self.folder / "meta.json").write_text(json.dumps(meta))


def _tokenize_into(folder: Path, path: Path, reader, tok, say, split) -> None:
    counts = RecordCounts()
    parts = [_Part(folder)] + ([_Part(folder / HELD_OUT)] if split else [])
    chars = ordinal = 0
    t0 = last = time.monotonic()

    def flush():
        nonlocal last
        for part in parts:
            part.flush(tok, str(path))
        now = time.monotonic()
        if now - last >= PROGRESS_SECONDS:
            last = now
            say(f"tokenizing {path.name}: {reader.progress()}, {counts.records:,} records, "
                f"{sum(p.tokens for p in parts):,} tokens, {now - t0:.0f} s")

    try:
        for n, rec in records(path, counts, reader):
            size = sum(len(rec[k]) for k in ("text", "prompt", "completion") if k in rec) + \
                sum(len(m["content"]) for m in rec.get("messages", ()))
            if size > tokenizing.PIECE_CHARS:
                say(f"{reader.where(n)}: one record of {_size(size)} characters; tokenizing it in pieces")
            part = parts[1] if split and held_out(split[1], ordinal, split[0]) else parts[0]
            ordinal += 1
            part.add(n, rec)
            chars += size
            if chars >= CHUNK_CHARS or len(part.chunk) >= 4096:
                flush()
                chars = 0
        flush()
    finally:
        for i, part in enumerate(parts):
            part.close(path, counts.mapped if i == 0 else {})


def _open_cache(folder: Path, split=None) -> TokenStream | None:
    """The cached stream in `folder` (with its held-out stream when `split`), or None if it is not whole."""
    stream = _open_part(folder)
    if stream is not None and split:
        stream.held_out = _open_part(folder / HELD_OUT)
        if stream.held_out is None:
            return None
    return stream


def _open_part(folder: Path) -> TokenStream | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
        n = meta["tokens"]
        if meta["format"] != CACHE_FORMAT or (folder / "ids.i32").stat().st_size != 4 * n \
                or (folder / "learn.u8").stat().st_size != n:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    counts = RecordCounts(text=meta["text"], chat=meta["chat"], completion=meta["completion"])
    for a, b, k in meta["mapped"]:
        counts.mapped[(a, b)] = k
    if n == 0:
        ids, learn = np.zeros(0, np.int32), np.zeros(0, np.bool_)
    else:  # copy-on-write maps: torch wants writable arrays; the files are never changed
        ids = np.memmap(folder / "ids.i32", dtype=np.int32, mode="c", shape=(n,))
        learn = np.memmap(folder / "learn.u8", dtype=np.bool_, mode="c", shape=(n,))
    return TokenStream(ids, learn, counts, meta["learned"], meta["max_id"], cached=True, folder=folder)


# --- packing and order -------------------------------------------------------------------------


@dataclass
class PackedData:
    """Blocks of `seq_len` tokens with a seeded visiting order. `ids` and `learn` hold every block
    (memory-mapped); `keep` indexes those with a token to learn, the blocks the run visits."""

    ids: torch.Tensor  # (all blocks, seq_len) int32
    learn: torch.Tensor  # (all blocks, seq_len) bool
    keep: torch.Tensor  # (blocks,) int64
    seed: int
    records: int
    tokens: int  # in the token stream, before the tail and unlearnable blocks were dropped
    description: str = ""  # what was taken from the file, in one line (see `describe`)
    held_out: "PackedData | None" = None  # the eval split's records, packed apart

    def __post_init__(self):
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def blocks(self) -> int:
        return self.keep.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.ids[self.keep]

    @property
    def labels(self) -> torch.Tensor:
        return self._labels(self.keep)

    def _labels(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.where(self.learn[rows], self.ids[rows], IGNORE)

    def _batch(self, rows: list[int] | torch.Tensor) -> Batch:
        rows = self.keep[torch.as_tensor(rows, dtype=torch.long)]
        return Batch(self.ids[rows].long(), self._labels(rows).long())

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the blocks for pass `epoch` over the data."""
        if epoch not in self._orders:
            seed = self.seed * ORDER_SEED_STRIDE + epoch  # < 2**64 for every seed the settings allow
            g = torch.Generator().manual_seed(seed)
            self._orders = {epoch: torch.randperm(self.blocks, generator=g)}  # keep one pass
        return self._orders[epoch]

    def block_at(self, position: int) -> int:
        """Which block sequence number `position` of the run is."""
        return int(self.order(position // self.blocks)[position % self.blocks])

    def batches_at(self, position: int, batch_size: int, grad_accum: int) -> list[Batch]:
        """One optimizer step's micro-batches, starting at sequence `position`."""
        return [self._batch([self.block_at(position + m * batch_size + b) for b in range(batch_size)])
                for m in range(grad_accum)]

    def in_order(self, batch_size: int) -> list[Batch]:
        """Every whole batch of blocks in file order (evaluation)."""
        n = self.blocks // batch_size * batch_size
        return [self._batch(list(range(i, i + batch_size))) for i in range(0, n, batch_size)]


def _pack_arrays(ids: np.ndarray, learn: np.ndarray, seq_len: int, *, seed: int, records: int,
                 source: str) -> PackedData:
    n = len(ids) // seq_len
    if n == 0:
        raise DataError(f"{source}: {len(ids)} tokens after tokenization, fewer than one sequence of "
                        f"--seq-len {seq_len}; add data or lower --seq-len")
    x = torch.from_numpy(ids[: n * seq_len].reshape(n, seq_len))
    m = torch.from_numpy(learn[: n * seq_len].reshape(n, seq_len))
    step = max(1, (64 << 20) // seq_len)  # the learn map is read a few MB at a time
    keep = torch.cat([m[i : i + step, 1:].any(dim=1) for i in range(0, n, step)])  # targets are labels[1:]
    if not bool(keep.any()):
        raise DataError(f"{source}: none of its {n} sequences of {seq_len} tokens has a token to learn "
                        "(no assistant turn); add assistant turns or text records")
    return PackedData(x, m, keep.nonzero().view(-1), seed, records, len(ids))


def pack(ids: list[int], labels: list[int], seq_len: int, *, seed: int, records: int, source: str) -> PackedData:
    """Cut a token stream into blocks of `seq_len`, keeping only blocks with a token to learn
    (a block whose targets are all IGNORE would have no loss).

    Raises:
        DataError: fewer tokens than one block, or no block with a token to learn.
    """
    labels_ = np.asarray(labels, dtype=np.int64)
    return _pack_arrays(np.asarray(ids, dtype=np.int32), labels_ != IGNORE, seq_len, seed=seed, records=records,
                        source=source)


def describe(path, data: PackedData, stream: TokenStream, seq_len: int, label: str = "") -> str:
    """What a run takes from a data file, every record and token accounted for, in one line."""
    c = stream.counts
    whole = stream.tokens // seq_len
    parts = [f"{path}{label}: {c.records:,} records ({c.kinds()})",
             f"{stream.tokens:,} tokens ({stream.learned:,} learned)",
             f"{data.blocks:,} sequences of {seq_len}"]
    dropped = [f"{whole - data.blocks:,} sequences with no token to learn"] if whole > data.blocks else []
    if stream.tokens % seq_len:
        dropped.append(f"a {stream.tokens % seq_len}-token tail")
    if dropped:
        parts[-1] += f" (left out: {' and '.join(dropped)})"
    if c.mapping():
        parts.append(c.mapping())
    if stream.cached:
        parts.append(f"tokens from the cache in {stream.folder}")
    return "; ".join(parts)


def load_data(path: str | Path, tok, seq_len: int, *, seed: int, vocab_size: int, data_sha256: str | None = None,
              tokenizer_id: str = "", cache_root: Path | None = None, say: Callable[[str], None] = lambda s: None,
              eval_split: float | None = None) -> PackedData:
    """Read, tokenize (or take from the cache) and pack a data file for a model of `vocab_size`
    tokens; its `description` says what it took from the file in one line. With `eval_split`, the
    records it holds out (by `seed`) are packed apart, in `held_out`, and never in the data.

    Raises:
        DataError: any problem with the file or its size; a token id outside the model's vocabulary;
            an eval split that holds out less than one sequence.
    """
    stream = tokenize(path, tok, data_sha256=data_sha256 or file_sha256(path), tokenizer_id=tokenizer_id,
                      cache_root=cache_root, say=say, eval_split=eval_split, seed=seed)
    top = max(stream.max_id, stream.held_out.max_id if stream.held_out is not None else 0)
    if top >= vocab_size:
        raise DataError(f"{path}: the tokenizer produced token id {top}, outside the model's vocabulary of "
                        f"{vocab_size}; the tokenizer files do not belong to this checkpoint")
    data = _pack_arrays(stream.ids, stream.learn, seq_len, seed=seed, records=stream.counts.records, source=str(path))
    label = f" (less the eval split {eval_split})" if eval_split else ""
    data.description = describe(path, data, stream, seq_len, label)
    if stream.held_out is not None:
        h = stream.held_out
        try:
            data.held_out = _pack_arrays(h.ids, h.learn, seq_len, seed=seed, records=h.counts.records,
                                         source=f"{path} (the eval split {eval_split} of its records)")
        except DataError as e:
            raise DataError(f"{e}; or raise --eval-split") from None
        data.held_out.description = describe(path, data.held_out, h, seq_len, f" (eval split {eval_split}, "
                                                                              f"seed {seed})")
    return data


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes; of a folder, of every file in it by relative name and bytes."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and CACHE_DIR not in p.parts) if path.is_dir() \
        else [path]
    h = hashlib.sha256()
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
