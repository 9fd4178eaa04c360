"""A checkpoint's own tokenizer and the token stream of `poros train`'s records (poros.finetune.data tokenizes
and packs with them): text records learn every token, prompt-completion records the completion and its
end-of-sequence token, chat records the assistant turns of the tokenizer's chat template."""

from __future__ import annotations

import hashlib
from pathlib import Path

from poros.errors import CheckpointError
from poros.finetune.records import DataError

IGNORE = -100  # label of a token that is not learned (torch's cross-entropy ignore_index)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
TOKENIZER_META = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "tokenizer.model", "vocab.json", "merges.txt")
PIECE_CHARS = 1 << 20  # a longer text record is tokenized in pieces cut at whitespace


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


def tokenizer_fingerprint(folder: str | Path) -> str:
    """The tokenizer files of a checkpoint folder, by content."""
    h = hashlib.sha256()
    for name in TOKENIZER_META:
        if (Path(folder) / name).is_file():
            h.update(name.encode() + b"\0" + (Path(folder) / name).read_bytes())
    return h.hexdigest()


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


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut just before a whitespace character
    that a non-space follows (where byte-level and sentencepiece pre-tokenizers split anyway)."""
    out, start = [], 0
    while len(text) - start > size:
        cut = start + size
        while cut < len(text) and not (text[cut].isspace() and cut + 1 < len(text) and not text[cut + 1].isspace()):
            cut += 1
        if cut >= len(text):
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _special_ends(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (e.g. BOS)."""
    bare = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return [], []


def _encode_long(tok, text: str) -> list[int]:
    pieces = _pieces(text, PIECE_CHARS)
    head, tail = _special_ends(tok)
    ids = list(head)
    for i in range(0, len(pieces), 8):  # a few pieces a call: the tokenizer runs them in parallel
        for seq in tok(pieces[i : i + 8], add_special_tokens=False)["input_ids"]:
            ids.extend(seq)
    return ids + tail


def encode_records(tok, records: list[dict], source: str, lines: list[int] | None = None
                   ) -> tuple[list[int], list[int]]:
    """Records as one token stream with its labels (IGNORE where nothing is learned).

    Text records get the tokenizer's special tokens and an end-of-sequence token, so packed
    documents stay apart; chat records are the template's rendering, assistant turns learned.
    `lines` gives each record's line in `source` (errors name it); default: 1, 2, ...

    Raises:
        DataError: `messages` with a tokenizer that has no chat template; text or prompt-completion records
            with one that has no end-of-sequence token.
    """
    lines = lines or list(range(1, len(records) + 1))
    chats = [i for i, r in enumerate(records) if "messages" in r]
    pairs = [r for r in records if "prompt" in r]
    pair_ids = iter(zip(*(tok([r[k] for r in pairs], add_special_tokens=False)["input_ids"]
                          for k in ("prompt", "completion"))) if pairs else [])
    head, tail = _special_ends(tok) if pairs else ([], [])
    if chats and not getattr(tok, "chat_template", None):
        raise DataError(f"{source}:{lines[chats[0]]}: a \"messages\" record, but the tokenizer has no chat template; "
                        "add one (chat_template in tokenizer_config.json or chat_template.jinja) or use text records")
    ids: list[int] = []
    labels: list[int] = []
    eos = tok.eos_token_id
    plain = next((i for i, r in enumerate(records) if "messages" not in r), None)
    if eos is None and plain is not None:
        kind = "prompt-completion" if "prompt" in records[plain] else "text"
        raise DataError(f"{source}:{lines[plain]}: a {kind} record, but the tokenizer has no end-of-sequence token "
                        "(eos_token), so packed records would run together and a completion would have no end to "
                        "learn; set eos_token in tokenizer_config.json, or use chat records")
    short = [r["text"] for r in records if "text" in r and len(r["text"]) <= PIECE_CHARS]
    text_ids = iter(tok(short, add_special_tokens=True)["input_ids"] if short else [])
    for line, rec in zip(lines, records):
        if "prompt" in rec:  # the prompt conditions, the completion is learned
            prompt, completion = next(pair_ids)
            prompt, completion = [*head, *prompt], [*completion, *tail]
            if eos is not None and (not completion or completion[-1] != eos):
                completion.append(eos)
            ids.extend(prompt + completion)
            labels.extend([IGNORE] * len(prompt) + completion)
            continue
        if "text" in rec:
            seq = list(next(text_ids)) if len(rec["text"]) <= PIECE_CHARS else _encode_long(tok, rec["text"])
            if eos is not None and (not seq or seq[-1] != eos):
                seq.append(eos)
            ids.extend(seq)
            labels.extend(seq)
            continue
        full, spans = _render_chat(tok, rec["messages"], f"{source}:{line}")
        try:
            enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # tokenizers without character offsets (no tokenizer.json)
            raise DataError(f"{source}:{line}: this tokenizer cannot map tokens to characters, needed to learn "
                            "only the assistant turns; add a tokenizer.json or use text records") from None
        for t, (start, _end) in zip(enc["input_ids"], enc["offset_mapping"]):
            ids.append(t)
            labels.append(t if any(a <= start < b for a, b in spans) else IGNORE)
    return ids, labels
