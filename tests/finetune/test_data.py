"""Text data for `poros train`: records read and checked line by line, tokenized with the checkpoint's
tokenizer (chat turns learned on the assistant only), packed, and ordered by position alone."""

from __future__ import annotations

import json

import pytest
import torch

from poros.errors import CheckpointError
from poros.finetune.data import DataError, load_data, pack, read_records
from poros.finetune import tokenizing
from poros.finetune.tokenizing import IGNORE, encode_records, load_tokenizer
from poros.finetune.records import RecordCounts, records
from poros.finetune.samples import generated_chats, generated_texts, train_tokenizer, write_jsonl
from tests.capabilities import requires_datasets


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
    [({"prompt": "x"}, "one of"), ({"text": "x", "messages": []}, "one of"), (["text"], "one of"),
     ({"text": 3}, '"text"'), ({"messages": [{"role": "user"}]}, '"messages"'), ({"messages": []}, '"messages"'),
     ({"text": " \n\t "}, '"text" must be a string of more than whitespace, got only whitespace'),
     ({"prompt": "q", "completion": "  "}, '"completion" must be a string of more than whitespace'),
     ({"text": "a \ud800 b"}, '"text" holds a lone surrogate escape'),
     ({"messages": [{"role": "user", "content": "\udfff"}]}, "message 0's content holds a lone surrogate escape")],
    ids=["neither", "both", "not-an-object", "text-not-string", "message-without-content", "messages-empty",
         "text-whitespace", "completion-whitespace", "text-lone-surrogate", "message-lone-surrogate"],
)
def test_a_bad_record_names_file_and_line(tmp_path, record, named):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n' + json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        read_records(path)
    line = _error_line(e)
    assert f"{path}:2:" in line and named in line


def test_text_with_whitespace_and_escaped_pairs_is_read(tmp_path):
    """Controls of the refusals above: whitespace around text, and a surrogate pair escaped as JSON writes it."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "  a b  "}, {"text": "smile \ud83d\ude00"}])
    assert read_records(path) == [{"text": "  a b  "}, {"text": "smile \U0001F600"}]


def test_text_records_need_an_end_of_sequence_token(tmp_path):
    """Without one, packed text records run together and a completion has no end to learn: refused naming the
    first such record; chat records, whose template ends each turn, need none (control)."""
    from transformers import PreTrainedTokenizerFast

    from poros.finetune.tokenizing import encode_records

    folder = tmp_path / "tok"
    train_tokenizer(folder, generated_texts(50))
    bare = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                   chat_template=PreTrainedTokenizerFast.from_pretrained(str(folder)).chat_template)
    assert bare.eos_token_id is None
    chats = [{"messages": m} for m in generated_chats(2)]
    for recs, line in (([*chats, {"text": "a b"}], 3), ([{"prompt": "q", "completion": "a"}], 1)):
        with pytest.raises(DataError) as e:
            encode_records(bare, recs, "d.jsonl")
        assert _error_line(e).startswith(f"d.jsonl:{line}: a ") and "no end-of-sequence token" in _error_line(e)
    ids, labels = encode_records(bare, chats, "d.jsonl")
    assert ids and any(x != -100 for x in labels)


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

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in generated_texts(30)])
    first = load_data(path, tok, 16, seed=0, vocab_size=len(tok), tokenizer_id="t")
    assert [p.name.split(".")[0] for p in (tmp_path / ".poros-cache").iterdir()] == ["d"]
    monkeypatch.setattr(tokenizing, "encode_records", lambda *a, **k: pytest.fail("tokenized again"))
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

    text = "  ".join(generated_texts(60, seed=5)) + "\n\nThe end."
    whole, _ = encode_records(tok, [{"text": text}], "d")
    monkeypatch.setattr(tokenizing, "PIECE_CHARS", 500)
    assert len(tokenizing._pieces(text, 500)) > 5
    pieces, _ = encode_records(tok, [{"text": text}], "d")
    assert pieces == whole
    said = []
    load_data(write_jsonl(tmp_path / "d.jsonl", [{"text": text}]), tok, 16, seed=0, vocab_size=len(tok),
              say=said.append)
    assert any(s.startswith(f"{tmp_path / 'd.jsonl'}:1: one record of") for s in said), said


def test_the_largest_seed_orders_the_data():
    from poros.checkers import MAX_SEED

    p = _packed(seed=MAX_SEED)
    assert sorted(p.block_at(g) for g in range(7)) == list(range(7))


# --- prompt-completion records ---------------------------------------------------------------------


def test_prompt_completion_records_learn_the_completion_and_its_end_only(tok):
    recs = [{"prompt": "What did the cat do?", "completion": " The cat sat on the mat."},
            {"text": "A dog sang."}]
    ids, labels = encode_records(tok, recs, "d")
    prompt = tok(recs[0]["prompt"], add_special_tokens=False)["input_ids"]
    completion = tok(recs[0]["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[: len(prompt) + len(completion)] == prompt + completion
    assert labels[: len(prompt)] == [IGNORE] * len(prompt)
    assert labels[len(prompt) : len(prompt) + len(completion)] == completion
    text = ids[len(prompt) + len(completion) :]
    assert labels[len(prompt) + len(completion) :] == text, "the text record after it learns every token"
    # control: the same words as one text record learn the prompt too
    _, as_text = encode_records(tok, [{"text": recs[0]["prompt"] + recs[0]["completion"]}], "d")
    assert IGNORE not in as_text


@pytest.mark.parametrize("record,named", [
    ({"prompt": "a"}, "got keys ['prompt']"),
    ({"prompt": "a", "completion": ""}, '"completion" must be a string of more than whitespace, got '),
    ({"prompt": "a", "completion": "b", "text": "c"}, "got keys ['completion', 'prompt', 'text']"),
], ids=["completion=missing", "completion=empty", "also=text"])
def test_a_bad_prompt_completion_record_names_file_and_line(tmp_path, record, named):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, record])
    with pytest.raises(DataError) as e:
        read_records(path)
    assert f"{path}:2: " in _error_line(e) and named in str(e.value)


def test_the_description_counts_prompt_completion_records(tmp_path, tok):
    recs = [{"prompt": f"Q{i}: what did {t[:20]}?", "completion": t} for i, t in enumerate(generated_texts(8))]
    data = load_data(write_jsonl(tmp_path / "d.jsonl", recs + [{"text": "x y z"}]), tok, 16, seed=0,
                     vocab_size=len(tok))
    assert ": 9 records (1 text, 0 chat, 8 prompt-completion); " in data.description


# --- the eval split --------------------------------------------------------------------------------


def _split_records(n: int) -> list[dict]:
    return [{"text": f"record {i}: {t}"} for i, t in enumerate(generated_texts(n, seed=3))]


def test_an_eval_split_holds_records_out_by_seed_and_never_trains_on_them(tmp_path, tok):
    from poros.finetune.data import held_out

    recs = _split_records(200)
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    data = load_data(path, tok, 16, seed=5, vocab_size=len(tok), eval_split=0.1)
    out = [i for i in range(len(recs)) if held_out(5, i, 0.1)]
    assert 8 <= len(out) <= 35, "about a tenth of the records"
    expect_eval = encode_records(tok, [recs[i] for i in out], "d")[0]
    expect_train = encode_records(tok, [r for i, r in enumerate(recs) if i not in set(out)], "d")[0]
    assert data.held_out.records == len(out) and data.records == len(recs) - len(out)
    assert data.tokens == len(expect_train) and data.held_out.tokens == len(expect_eval)
    n = len(expect_train) // 16 * 16
    assert torch.equal(data.ids.reshape(-1).long(), torch.tensor(expect_train[:n]))
    assert "(eval split 0.1, seed 5): " in data.held_out.description
    assert "(less the eval split 0.1): " in data.description
    # the same seed holds out the same records (from the cache, too); another seed others
    again = load_data(path, tok, 16, seed=5, vocab_size=len(tok), eval_split=0.1)
    assert torch.equal(again.held_out.ids, data.held_out.ids) and "from the cache" in again.description
    other = load_data(path, tok, 16, seed=6, vocab_size=len(tok), eval_split=0.1)
    assert other.held_out.tokens != data.held_out.tokens or not torch.equal(other.held_out.ids, data.held_out.ids)
    whole = load_data(path, tok, 16, seed=5, vocab_size=len(tok))
    assert whole.held_out is None and whole.tokens == data.tokens + data.held_out.tokens


def test_an_eval_split_too_small_for_one_sequence_is_refused(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", _split_records(30))
    with pytest.raises(DataError) as e:
        load_data(path, tok, 512, seed=0, vocab_size=len(tok), eval_split=0.02)
    assert "the eval split 0.02 of its records" in _error_line(e) and "raise --eval-split" in str(e.value)


# --- tables the datasets library reads ---------------------------------------------------------------


def _mixed_records() -> list[dict]:
    return ([{"text": t} for t in generated_texts(20)] + [{"messages": m} for m in generated_chats(10)]
            + [{"prompt": f"Say {i}.", "completion": f" {i} is said."} for i in range(10)])


@requires_datasets
@pytest.mark.parametrize("form", ["parquet", "parquet-folder", "arrow", "save_to_disk", "dataset_dict"])
def test_a_table_is_read_as_its_records(tmp_path, tok, form):
    """Each form holds the records of one JSON Lines file, a column per key: the tokens are the same."""
    import datasets

    recs = _mixed_records()
    jsonl = load_data(write_jsonl(tmp_path / "d.jsonl", recs), tok, 16, seed=0, vocab_size=len(tok))
    by_kind = [[r for r in recs if k in r] for k in ("text", "messages", "prompt")]
    parts = [datasets.Dataset.from_list(rs) for rs in by_kind]
    whole = datasets.concatenate_datasets(parts)  # columns a row lacks are None there
    if form == "parquet":
        whole.to_parquet(str(tmp_path / "d.parquet"))
        path = tmp_path / "d.parquet"
    elif form == "parquet-folder":
        (tmp_path / "pq").mkdir()
        for i in range(3):  # files of one schema, in name order
            whole.shard(3, i, contiguous=True).to_parquet(str(tmp_path / "pq" / f"part-{i}.parquet"))
        path = tmp_path / "pq"
    elif form == "arrow":
        whole.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    elif form == "save_to_disk":
        whole.save_to_disk(str(tmp_path / "saved"))
        path = tmp_path / "saved"
    else:
        datasets.DatasetDict({"train": whole, "test": parts[0]}).save_to_disk(str(tmp_path / "dd"))
        path = tmp_path / "dd"
    data = load_data(path, tok, 16, seed=0, vocab_size=len(tok))
    assert torch.equal(data.ids, jsonl.ids) and torch.equal(data.learn, jsonl.learn), form
    assert f"{path}: 40 records (20 text, 10 chat, 10 prompt-completion); " in data.description
    # control: a table of other records has other tokens
    other = tmp_path / "other.parquet"
    datasets.Dataset.from_list(by_kind[0][:15]).to_parquet(str(other))
    assert load_data(other, tok, 16, seed=0, vocab_size=len(tok)).tokens != jsonl.tokens


@requires_datasets
def test_a_bad_table_row_and_a_dataset_dict_without_train_are_named(tmp_path, tok):
    import datasets

    path = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"text": "fine"}, {"text": ""}]).to_parquet(str(path))
    with pytest.raises(DataError) as e:
        load_data(path, tok, 16, seed=0, vocab_size=len(tok))
    assert f"{path}: row 2: " in _error_line(e) and '"text" must be a string of more than whitespace' in str(e.value)
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": "a"}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="a DatasetDict without a train split \\(splits: test\\)"):
        load_data(tmp_path / "dd", tok, 16, seed=0, vocab_size=len(tok))


def test_a_table_without_the_datasets_library_says_how_to_install_it(tmp_path, tok, monkeypatch):
    import sys

    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets then raises ImportError
    with pytest.raises(DataError) as e:
        load_data(path, tok, 16, seed=0, vocab_size=len(tok))
    assert _error_line(e) == (f"{path}: reading Parquet or Arrow data needs the datasets library: "
                              "pip install 'poros[data]' (or pip install datasets)")
    assert not (tmp_path / ".poros-cache").exists()
