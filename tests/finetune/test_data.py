"""Text data for `poros train`: records read and checked line by line, tokenized with the checkpoint's
tokenizer (chat turns learned on the assistant only), packed, and ordered by position alone."""

from __future__ import annotations

import json

import pytest
import torch

from poros.errors import CheckpointError
from poros.finetune.data import IGNORE, DataError, encode_records, load_data, load_tokenizer, pack, read_records
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
