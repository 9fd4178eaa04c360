"""Generated training data and a tokenizer trained on it, built locally (nothing from a hub), to try `poros train`
end to end on any registered shape (scripts/train_gpu_check.py, scripts/tiny_checkpoint.py) and for the tests.

    texts = generated_texts(200)
    write_jsonl(path, [{"text": t} for t in texts] + [{"messages": m} for m in generated_chats(50)])
    train_tokenizer(folder, texts, vocab_size=512)   # byte-level BPE, saved as a transformers tokenizer
    tiny_checkpoint(folder, "tiny-qwen2", texts)     # bf16 safetensors + config.json + that tokenizer

The text is a small seeded grammar (subject, verb, place, ...), so a model can learn it and its loss falls within a
few steps; chats are arithmetic questions with their answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_SUBJECTS = "the cat|a dog|the old farmer|my sister|the small robot|a red bird|the teacher|the neighbour".split("|")
_VERBS = "sat|walked|slept|sang|waited|read a book|painted a fence|looked around".split("|")
_PLACES = "on the mat|in the garden|near the river|under the bridge|at the station|by the window".split("|")
_TIMES = "this morning|after lunch|every evening|at night|on sunday|before the rain".split("|")


def generated_texts(n: int, seed: int = 0) -> list[str]:
    """`n` short English-like paragraphs from a seeded grammar."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        sentences = [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_PLACES)} {rng.choice(_TIMES)}."
                     for _ in range(rng.randint(2, 5))]
        out.append(" ".join(s.capitalize() for s in sentences))
    return out


def generated_chats(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` conversations: a system line, then one or two arithmetic questions with their answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "You add numbers."}]
        for _ in range(rng.randint(1, 2)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            msgs += [{"role": "user", "content": f"What is {a} plus {b}?"},
                     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        out.append(msgs)
    return out


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    from poros.common.atomic import write_atomic

    path = Path(path)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records), "the records")
    return path


def train_tokenizer(folder: str | Path, texts: list[str], *, vocab_size: int = 512, chat_template: bool = True):
    """Train a byte-level BPE tokenizer on `texts` (about a second) and save it to `folder` as a
    transformers tokenizer, with `CHAT_TEMPLATE` unless `chat_template` is False. Ids < vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE if chat_template else None)
    fast.save_pretrained(str(folder))
    return fast


def tiny_checkpoint(folder: str | Path, model: str = "tiny-qwen2", texts: list[str] | None = None, *,
                    seed: int = 0, chat_template: bool = True, vocab_size: int = 512) -> Path:
    """A seeded registered shape saved as a bf16 Hugging Face checkpoint (config.json + safetensors),
    with a tokenizer trained on `texts` (default: `generated_texts(200)`) in the same folder."""
    import torch
    import transformers

    from poros.models.shapes import get_shape

    folder = Path(folder)
    config = get_shape(model).config()
    tok = train_tokenizer(folder, texts if texts is not None else generated_texts(200), vocab_size=vocab_size,
                          chat_template=chat_template)
    if len(tok) > config.vocab_size:
        raise ValueError(f"a tokenizer of {len(tok)} tokens exceeds {model}'s vocabulary of {config.vocab_size}")
    config.eos_token_id = config.pad_token_id = tok.eos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.save_pretrained(str(folder))
    return folder
