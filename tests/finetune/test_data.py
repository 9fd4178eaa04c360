"""Text data for `poros train`: records read and checked line by line, tokenized with the checkpoint's
tokenizer (chat turns learned on the assistant only), packed, and ordered by position alone."""

from __future__ import annotations

import json

import pytest
import torch

from poros.errors import CheckpointError
from poros.finetune.data import IGNORE, DataError, encode_records, load_data, load_tokenizer, pack, read_records
from poros.finetune.records import RecordCounts, records
from tests.fixtures import generated_chats, generated_texts, train_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(folder, generated_texts(100), vocab_size=400)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok-plain")
    train_tokenizer(folder, generated_texts(100), vocab_size=400, chat_template=False)
    return load_tokenizer(folder)


def _error_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, f"expected one line, got {text!r}"
    return text


# --- reading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["file=empty", "file=blank-lines"])
def test_empty_data_is_refused(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        read_records(path)
    line = _error_line(e)
    assert str(path) in line and "empty" in line


def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "cut off\n{"text": "fine"}\n')
    with pytest.raises(DataError) as e:
        read_records(path)
    assert f"{path}:3:" in _error_line(e) and "not JSON" in str(e.value)


@pytest.mark.parametrize(
    "record,named",
    [({"prompt": "x"}, "either"), ({"text": "x", "messages": []}, "either"), (["text"], "either"),
     ({"text": 3}, '"text"'), ({"messages": [{"role": "user"}]}, '"messages"'), ({"messages": []}, '"messages"')],
    ids=["neither", "both", "not-an-object", "text-not-string", "message-without-content", "messages-empty"],
)
def test_a_bad_record_names_file_and_line(tmp_path, record, named):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        read_records(path)
    line = _error_line(e)
    assert f"{path}:2:" in line and named in line


def test_records_are_read_in_order(tmp_path):
    recs = [{"text": "a b"}, {"messages": [{"role": "user", "content": "q"}]}, {"text": "c"}]
    assert read_records(write_jsonl(tmp_path / "d.jsonl", recs)) == recs


def test_a_folder_without_tokenizer_files_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        load_tokenizer(tmp_path)
    line = _error_line(e)
    assert str(tmp_path) in line and "tokenizer" in line


# --- tokenization --------------------------------------------------------------------------------


def test_text_records_learn_every_token_and_end_with_eos(tok):
    texts = generated_texts(3, seed=4)
    ids, labels = encode_records(tok, [{"text": t} for t in texts], "d")
    assert labels == ids
    expected = []
    for t in texts:
        expected += tok(t)["input_ids"] + [tok.eos_token_id]
    assert ids == expected
    assert ids.count(tok.eos_token_id) == 3


def test_chat_records_learn_only_the_assistant_turns(tok):
    chat = generated_chats(1, seed=3)[0] + [{"role": "user", "content": "Thanks."},
                                            {"role": "assistant", "content": "You are welcome."}]
    ids, labels = encode_records(tok, [{"messages": chat}], "d")
    assert len(ids) == len(labels) and ids == tok(tok.apply_chat_template(chat, tokenize=False),
                                                  add_special_tokens=False)["input_ids"]
    learned = [[]]  # runs of learned tokens, decoded
    for t, y in zip(ids, labels):
        assert y in (t, IGNORE)
        if y == IGNORE:
            if learned[-1]:
                learned.append([])
        else:
            learned[-1].append(t)
    runs = [tok.decode(r) for r in learned if r]
    answers = [m["content"] for m in chat if m["role"] == "assistant"]
    assert runs == [f"{a}<|im_end|>\n" for a in answers], runs
    # the negative side: no token of the system or user turns is learned
    heard = tok.decode([t for t, y in zip(ids, labels) if y != IGNORE])
    assert all(m["content"] not in heard for m in chat if m["role"] != "assistant")


def test_messages_without_a_chat_template_are_refused(plain_tok):
    with pytest.raises(DataError) as e:
        encode_records(plain_tok, [{"text": "a"}, {"messages": [{"role": "user", "content": "q"}]}], "d.jsonl")
    line = _error_line(e)
    assert "d.jsonl:2:" in line and "chat template" in line


def test_a_template_that_rewrites_history_is_refused(tok):
    """A template whose rendering of the turns before an answer is not a prefix of the whole
    conversation (here it starts with the number of turns) leaves no way to mask."""
    original = tok.chat_template
    tok.chat_template = "{{ messages|length }}" + original
    try:
        with pytest.raises(DataError) as e:
            encode_records(tok, [{"messages": generated_chats(1)[0]}], "d.jsonl")
        assert "prefix" in _error_line(e)
    finally:
        tok.chat_template = original


def test_token_ids_beyond_the_model_vocabulary_are_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in generated_texts(20)])
    packed = load_data(path, tok, 16, seed=0, vocab_size=len(tok))  # fits
    assert packed.blocks > 0
    with pytest.raises(DataError) as e:
        load_data(path, tok, 16, seed=0, vocab_size=100)
    assert "vocabulary of 100" in _error_line(e)


# --- packing and order ---------------------------------------------------------------------------


def test_fewer_tokens_than_one_sequence_is_refused():
    with pytest.raises(DataError) as e:
        pack(list(range(63)), list(range(63)), 64, seed=0, records=1, source="d.jsonl")
    line = _error_line(e)
    assert "63 tokens" in line and "--seq-len 64" in line


def test_packing_cuts_blocks_and_drops_the_tail_and_unlearnable_blocks():
    ids = list(range(10))
    labels = [0, 1, 2, IGNORE, IGNORE, IGNORE, 6, 7, 8, 9]  # block 1 (3..5) learns nothing
    p = pack(ids, labels, 3, seed=0, records=1, source="d")
    assert p.input_ids.tolist() == [[0, 1, 2], [6, 7, 8]]
    assert p.labels.tolist() == [[0, 1, 2], [6, 7, 8]]
    # a block whose only learned token is its first (never a target after the shift) is dropped too
    p = pack([1, 2, 3, 4], [1, IGNORE, 3, 4], 2, seed=0, records=1, source="d")
    assert p.input_ids.tolist() == [[3, 4]]
    with pytest.raises(DataError) as e:
        pack([1, 2, 3], [IGNORE] * 3, 3, seed=0, records=1, source="d.jsonl")
    assert "no assistant turn" in _error_line(e)


def _packed(seed: int, blocks: int = 7):
    ids = list(range(blocks * 4))
    return pack(ids, ids, 4, seed=seed, records=1, source="d")


def test_each_pass_visits_every_block_once_in_a_seeded_order():
    p = _packed(seed=0)
    first = [p.block_at(g) for g in range(7)]
    second = [p.block_at(g) for g in range(7, 14)]
    assert sorted(first) == sorted(second) == list(range(7))
    assert first != second, "every pass over the data gets its own order"
    other = _packed(seed=1)
    assert [other.block_at(g) for g in range(7)] != first, "another seed, another order"


def test_batches_depend_on_the_position_alone():
    """A resumed run builds its data afresh and starts at a position: it must see what an
    uninterrupted run sees there, whatever was read before."""
    walked = _packed(seed=3)
    for pos in range(0, 40, 6):
        walked.batches_at(pos, 2, 3)
    fresh = _packed(seed=3)
    for pos in (36, 6, 13):
        a, b = walked.batches_at(pos, 2, 3), fresh.batches_at(pos, 2, 3)
        assert len(a) == 3 and all(x.input_ids.shape == (2, 4) for x in a)
        assert all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels) for x, y in zip(a, b))
    shifted = fresh.batches_at(37, 2, 3)
    assert not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(walked.batches_at(36, 2, 3), shifted))
    micro = fresh.batches_at(6, 2, 3)
    assert [int(b) for b in micro[1].input_ids[:, 0] // 4] == [fresh.block_at(8), fresh.block_at(9)]
    assert micro[0].input_ids.dtype == torch.int64


def test_in_order_keeps_whole_batches():
    p = _packed(seed=0)
    batches = p.in_order(3)
    assert [b.input_ids[:, 0].tolist() for b in batches] == [[0, 4, 8], [12, 16, 20]]


def test_a_tokenizer_without_character_offsets_is_refused_for_chats(tok):
    class NoOffsets:  # what a tokenizer without tokenizer.json does when asked for offsets
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kwargs):
            if kwargs.get("return_offsets_mapping"):
                raise NotImplementedError("return_offset_mapping is not available")
            return tok(text, **kwargs)

    assert encode_records(NoOffsets(), [{"text": "the cat"}], "d")[0], "text records need no offsets"
    with pytest.raises(DataError) as e:
        encode_records(NoOffsets(), [{"messages": generated_chats(1)[0]}], "d.jsonl")
    assert "d.jsonl:1:" in _error_line(e) and "tokenizer.json" in str(e.value)


# --- what a file holds: roles, encodings, compression, counts ------------------------------------


def test_role_spellings_are_mapped_counted_and_learned(tmp_path, tok):
    """Chats whose assistant is spelled `Assistant`, `gpt` or `bot` are learned like any other (they
    were dropped silently when only `assistant` was recognised); the mapping is reported once."""
    chats = generated_chats(3)
    spelled = []
    for msgs, (user, helper) in zip(chats, [("User", "Assistant"), ("human", "gpt"), ("user", "bot")]):
        spelled.append({"messages": [{**m, "role": {"user": user, "assistant": helper}.get(m["role"], m["role"])}
                                     for m in msgs]})
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in generated_texts(2)] + spelled)
    counts = RecordCounts()
    got = [rec for _, rec in records(path, counts)]
    assert got[2:] == [{"messages": m} for m in chats], "every role is one the template knows"
    assert (counts.text, counts.chat) == (2, 3)
    assert counts.mapping().startswith("roles mapped: 'Assistant' -> assistant"), counts.mapping()
    assert "'gpt' -> assistant" in counts.mapping() and "'human' -> user" in counts.mapping()
    _, labels = encode_records(tok, got[2:], str(path))
    assert sum(y != IGNORE for y in labels) > 0, "the mapped assistant turns are learned"


def test_an_unknown_role_names_file_line_and_role(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"messages": [{"role": "user", "content": "q"},
                                                                           {"role": "narrator", "content": "x"}]}])
    with pytest.raises(DataError) as e:
        read_records(path)
    line = _error_line(e)
    assert f"{path}:2:" in line and "'narrator'" in line and "assistant" in line


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError) as e:
        read_records(path)
    line = _error_line(e)
    assert f"{path}:2:" in line and "not UTF-8" in line and "0xe9" in line


def test_a_gzip_file_is_read_as_its_text(tmp_path):
    import gzip

    recs = [{"text": t} for t in generated_texts(5)]
    plain = write_jsonl(tmp_path / "d.jsonl", recs)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_records(packed) == recs
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(DataError) as e:
        read_records(broken)
    assert str(broken) in _error_line(e) and "gzip" in str(e.value)


def test_the_description_accounts_for_every_record_and_token(tmp_path, tok):
    recs = [{"text": t} for t in generated_texts(10)] + [{"messages": m} for m in generated_chats(4)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    data = load_data(path, tok, 16, seed=0, vocab_size=len(tok))
    ids, labels = encode_records(tok, recs, str(path))
    line = data.description
    assert line.startswith(f"{path}: 14 records (10 text, 4 chat); {len(ids):,} tokens "
                           f"({sum(y != IGNORE for y in labels):,} learned); {data.blocks} sequences of 16"), line
    if len(ids) % 16:
        assert f"a {len(ids) % 16}-token tail" in line


# --- streaming, the cache, long records ------------------------------------------------------------


def test_tokenization_is_cached_beside_the_data_and_keyed_by_its_content(tmp_path, tok, monkeypatch):
    import poros.finetune.data as data_mod

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in generated_texts(30)])
    first = load_data(path, tok, 16, seed=0, vocab_size=len(tok), tokenizer_id="t")
    assert [p.name.split(".")[0] for p in (tmp_path / ".poros-cache").iterdir()] == ["d"]
    monkeypatch.setattr(data_mod, "encode_records", lambda *a, **k: pytest.fail("tokenized again"))
    again = load_data(path, tok, 16, seed=0, vocab_size=len(tok), tokenizer_id="t")
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    assert "tokens from the cache" in again.description and "tokens from the cache" not in first.description
    # negative controls: other data, or another tokenizer, are tokenized afresh
    path.write_text(path.read_text() + json.dumps({"text": "one more line"}) + "\n")
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        load_data(path, tok, 16, seed=0, vocab_size=len(tok), tokenizer_id="t")
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        load_data(write_jsonl(path, [{"text": t} for t in generated_texts(30)]), tok, 16, seed=0,
                  vocab_size=len(tok), tokenizer_id="another")


def test_a_refused_file_leaves_no_cache(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in generated_texts(20)) + "{oops\n")
    with pytest.raises(DataError):
        load_data(path, tok, 16, seed=0, vocab_size=len(tok))
    assert list((tmp_path / ".poros-cache").iterdir()) == []


def test_tokenization_streams_in_bounded_memory_and_shows_progress(tmp_path, tok, monkeypatch):
    """A file of several MB is tokenized with a few MB of Python memory at its peak (a whole-file
    tokenization holds every token as Python ints: ~70 bytes a token, hundreds of MB here), and
    reports its progress as it goes."""
    import tracemalloc

    import poros.finetune.data as data_mod

    texts = generated_texts(2000)
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(18):
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    size = path.stat().st_size
    assert size > 6e6
    monkeypatch.setattr(data_mod, "CHUNK_CHARS", 1 << 18)
    monkeypatch.setattr(data_mod, "PROGRESS_SECONDS", 0.0)
    said = []
    tracemalloc.start()
    try:
        data = load_data(path, tok, 64, seed=0, vocab_size=len(tok), say=said.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data.tokens > 1_000_000
    assert peak < 40e6, f"tokenizing {size / 1e6:.1f} MB took {peak / 1e6:.1f} MB of Python memory at its peak"
    progress = [s for s in said if s.startswith("tokenizing big.jsonl: ")]
    assert len(progress) > 3 and "% (" in progress[0] and progress[-1].split(":")[1].strip().startswith("100%"), said


def test_a_huge_text_record_is_tokenized_in_pieces_to_the_same_tokens(tmp_path, tok, monkeypatch):
    import poros.finetune.data as data_mod

    text = "  ".join(generated_texts(60, seed=5)) + "\n\nThe end."
    whole, _ = encode_records(tok, [{"text": text}], "d")
    monkeypatch.setattr(data_mod, "PIECE_CHARS", 500)
    assert len(data_mod._pieces(text, 500)) > 5
    pieces, _ = encode_records(tok, [{"text": text}], "d")
    assert pieces == whole
    said = []
    load_data(write_jsonl(tmp_path / "d.jsonl", [{"text": text}]), tok, 16, seed=0, vocab_size=len(tok),
              say=said.append)
    assert any(s.startswith(f"{tmp_path / 'd.jsonl'}:1: one record of") for s in said), said


def test_the_largest_seed_orders_the_data():
    from poros.settings import MAX_SEED

    p = _packed(seed=MAX_SEED)
    assert sorted(p.block_at(g) for g in range(7)) == list(range(7))
