"""Text data for `poros train`: JSON Lines records, tokenized with the checkpoint's own tokenizer,
packed into blocks of seq_len tokens and visited in a seeded order that depends only on the position.

A record is `{"text": "..."}` (every token is learned) or `{"messages": [{"role", "content"}, ...]}`,
rendered with the tokenizer's chat template and learned on the assistant turns only (labels -100
elsewhere). Records are concatenated in file order and cut into blocks; the tail shorter than a
block is dropped. Sequence g of the run is block `order(g // n)[g % n]`, with one seeded permutation
per pass over the n blocks, so a run resumed at position g sees exactly the batches it would have.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from poros.engine.data import Batch
from poros.errors import CheckpointError, PorosError

IGNORE = -100  # label of a token that is not learned (torch's cross-entropy ignore_index)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
ORDER_SEED_STRIDE = 1_000_003


class DataError(PorosError):
    """A data file is empty, malformed or too small for the run."""


def load_tokenizer(folder: str | Path):
    """The checkpoint folder's own tokenizer (never fetched from a hub).

    Raises:
        CheckpointError: the folder has no tokenizer files, or they do not load.
    """
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{folder}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}); "
                              "copy the tokenizer of the model into the checkpoint folder")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder}: the tokenizer does not load: {str(e).splitlines()[0]}") from None


def read_records(path: str | Path) -> list[dict]:
    """Every record of a JSON Lines file, checked: an object with `text` (a string) or `messages`
    (a list of {"role", "content"} strings). Blank lines are skipped.

    Raises:
        DataError: naming the file and line of the first bad record, or an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    records = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno}); expected one JSON object "
                                'per line, e.g. {"text": "..."}') from None
            records.append(_check_record(rec, f"{path}:{n}"))
    if not records:
        raise DataError(f"{path}: no records (the file is empty); expected JSON Lines with "
                        '{"text": ...} or {"messages": [...]} per line')
    return records


def _check_record(rec, where: str) -> dict:
    if not isinstance(rec, dict) or ("text" in rec) == ("messages" in rec):
        got = f"keys {sorted(rec)}" if isinstance(rec, dict) else type(rec).__name__
        raise DataError(f'{where}: expected an object with either "text" or "messages", got {got}')
    if "text" in rec:
        if not isinstance(rec["text"], str) or not rec["text"]:
            raise DataError(f'{where}: "text" must be a non-empty string, got {rec["text"]!r:.60}')
        return rec
    msgs = rec["messages"]
    ok = isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
    if not ok:
        raise DataError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}, '
                        f"got {msgs!r:.60}")
    return rec


# --- tokenization ------------------------------------------------------------------------------


def _render_chat(tok, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as the template renders it, and the character spans of its assistant turns:
    each turn spans from the end of the rendering of the turns before it (with the generation
    prompt) to the end of the rendering through it, so the turn's end-of-turn marker is learned."""

    def render(msgs, gen):
        if not msgs:
            return ""
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through)):
            raise DataError(f"{where}: the chat template does not render the conversation before assistant turn "
                            f"{i} as a prefix of the whole, so its tokens cannot be told apart; use text records")
        spans.append((len(before), len(through)))
    return full, spans


def encode_records(tok, records: list[dict], source: str) -> tuple[list[int], list[int]]:
    """All records as one token stream with its labels (IGNORE where nothing is learned).

    Text records get the tokenizer's special tokens and an end-of-sequence token, so packed
    documents stay apart; chat records are the template's rendering, assistant turns learned.

    Raises:
        DataError: `messages` with a tokenizer that has no chat template.
    """
    chats = [i for i, r in enumerate(records) if "messages" in r]
    if chats and not getattr(tok, "chat_template", None):
        raise DataError(f"{source}: record {chats[0] + 1} has \"messages\" but the tokenizer has no chat template; "
                        "add one (chat_template in tokenizer_config.json or chat_template.jinja) or use text records")
    ids: list[int] = []
    labels: list[int] = []
    eos = tok.eos_token_id
    texts = [r["text"] for r in records if "text" in r]
    text_ids = iter(tok(texts, add_special_tokens=True)["input_ids"] if texts else [])
    for n, rec in enumerate(records, 1):
        if "text" in rec:
            seq = list(next(text_ids))
            if eos is not None and (not seq or seq[-1] != eos):
                seq.append(eos)
            ids.extend(seq)
            labels.extend(seq)
            continue
        full, spans = _render_chat(tok, rec["messages"], f"{source} record {n}")
        try:
            enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # tokenizers without character offsets (no tokenizer.json)
            raise DataError(f"{source} record {n}: this tokenizer cannot map tokens to characters, needed to learn "
                            "only the assistant turns; add a tokenizer.json or use text records") from None
        for t, (start, _end) in zip(enc["input_ids"], enc["offset_mapping"]):
            ids.append(t)
            labels.append(t if any(a <= start < b for a, b in spans) else IGNORE)
    return ids, labels


# --- packing and order -------------------------------------------------------------------------


@dataclass
class PackedData:
    """Blocks of `seq_len` tokens (int32) with their labels, and a seeded visiting order."""

    input_ids: torch.Tensor  # (blocks, seq_len)
    labels: torch.Tensor
    seed: int
    records: int
    tokens: int  # in the token stream, before the tail and unlearnable blocks were dropped

    def __post_init__(self):
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def blocks(self) -> int:
        return self.input_ids.shape[0]

    def order(self, epoch: int) -> torch.Tensor:
        """The permutation of the blocks for pass `epoch` over the data."""
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * ORDER_SEED_STRIDE + epoch)
            self._orders = {epoch: torch.randperm(self.blocks, generator=g)}  # keep one pass
        return self._orders[epoch]

    def block_at(self, position: int) -> int:
        """Which block sequence number `position` of the run is."""
        return int(self.order(position // self.blocks)[position % self.blocks])

    def batches_at(self, position: int, batch_size: int, grad_accum: int) -> list[Batch]:
        """One optimizer step's micro-batches, starting at sequence `position`."""
        out = []
        for m in range(grad_accum):
            rows = [self.block_at(position + m * batch_size + b) for b in range(batch_size)]
            out.append(Batch(self.input_ids[rows].long(), self.labels[rows].long()))
        return out

    def in_order(self, batch_size: int) -> list[Batch]:
        """Every whole batch of blocks in file order (evaluation)."""
        n = self.blocks // batch_size * batch_size
        return [Batch(self.input_ids[i : i + batch_size].long(), self.labels[i : i + batch_size].long())
                for i in range(0, n, batch_size)]


def pack(ids: list[int], labels: list[int], seq_len: int, *, seed: int, records: int, source: str) -> PackedData:
    """Cut the token stream into blocks of `seq_len`, keeping only blocks with a token to learn
    (a block whose targets are all IGNORE would have no loss).

    Raises:
        DataError: fewer tokens than one block, or no block with a token to learn.
    """
    n = len(ids) // seq_len
    if n == 0:
        raise DataError(f"{source}: {len(ids)} tokens after tokenization, fewer than one sequence of "
                        f"--seq-len {seq_len}; add data or lower --seq-len")
    x = torch.tensor(ids[: n * seq_len], dtype=torch.int32).view(n, seq_len)
    y = torch.tensor(labels[: n * seq_len], dtype=torch.int32).view(n, seq_len)
    keep = (y[:, 1:] != IGNORE).any(dim=1)  # the model predicts labels[1:] from inputs[:-1]
    if not bool(keep.any()):
        raise DataError(f"{source}: none of its {n} sequences of {seq_len} tokens has a token to learn "
                        "(no assistant turn); add assistant turns or text records")
    return PackedData(x[keep].contiguous(), y[keep].contiguous(), seed, records, len(ids))


def load_data(path: str | Path, tok, seq_len: int, *, seed: int, vocab_size: int) -> PackedData:
    """Read, tokenize and pack a JSON Lines file for a model of `vocab_size` tokens.

    Raises:
        DataError: any problem with the file or its size; a token id outside the model's vocabulary.
    """
    records = read_records(path)
    ids, labels = encode_records(tok, records, str(path))
    top = max(ids, default=0)
    if top >= vocab_size:
        raise DataError(f"{path}: the tokenizer produced token id {top}, outside the model's vocabulary of "
                        f"{vocab_size}; the tokenizer files do not belong to this checkpoint")
    return pack(ids, labels, seq_len, seed=seed, records=len(records), source=str(path))


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
