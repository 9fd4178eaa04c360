"""Generated training data and its tokenizer (poros/finetune/samples.py): seeded, readable back, within a vocabulary."""

from __future__ import annotations

import json

from poros.finetune.samples import generated_chats, generated_texts, train_tokenizer, write_jsonl


def test_the_data_is_seeded_and_the_chats_answer_right(tmp_path):
    assert generated_texts(20, seed=3) == generated_texts(20, seed=3) != generated_texts(20, seed=4)
    for chat in generated_chats(30, seed=1):
        for question, answer in zip(chat[1::2], chat[2::2]):
            a, b = (int(x) for x in question["content"].removeprefix("What is ").removesuffix("?").split(" plus "))
            assert (question["role"], answer["role"], answer["content"]) == ("user", "assistant", f"{a} plus {b} is {a + b}.")
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in generated_texts(5)])
    assert [json.loads(line)["text"] for line in path.read_text().splitlines()] == generated_texts(5)


def test_the_tokenizer_keeps_its_ids_below_its_vocabulary(tmp_path):
    texts = generated_texts(100)
    tok = train_tokenizer(tmp_path, texts, vocab_size=300)
    ids = [i for t in texts for i in tok(t)["input_ids"]]
    assert len(tok) <= 300 and max(ids) < 300 and tok.decode(tok(texts[0])["input_ids"]) == texts[0]
    chat = tok.apply_chat_template(generated_chats(1)[0], tokenize=False)
    assert chat.startswith("<|im_start|>system\nYou add numbers.<|im_end|>\n")
