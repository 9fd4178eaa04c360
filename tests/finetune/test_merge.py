"""After training: `poros export --merge` writes peft's merged weights bit for bit as a bf16 checkpoint
transformers loads alone, and `poros generate` continues a prompt greedily with base + adapter."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from poros.cli import main
from poros.finetune.samples import generated_texts, write_jsonl
from tests.capabilities import requires_bitsandbytes
from tests.fixtures import one_line_refusal, tiny_checkpoint
from tests.store.test_build import assert_all_equal

pytestmark = requires_bitsandbytes
# A merged model rounds W + delta to bf16 once per weight; peft's unmerged model adds the adapter's output
# at run time. Their logits then differ by bf16 rounding, not bits: at most LOGIT_ULPS units in the last
# place of bf16 at the largest logit's magnitude (measured: one unit on tiny-qwen2).
LOGIT_ULPS = 4


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(x, 2**-100))) - 7)  # bf16 keeps 8 significant bits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny-qwen2 checkpoint and a 4-step run on it (its adapter moved well beyond bf16 rounding)."""
    root = tmp_path_factory.mktemp("merge")
    texts = generated_texts(120)
    ckpt = tiny_checkpoint(root / "ckpt", "tiny-qwen2", texts)
    data = write_jsonl(root / "data.jsonl", [{"text": t} for t in texts])
    assert main(["train", "--model", str(ckpt), "--data", str(data), "--out", str(root / "run"), "--steps", "4",
                 "--seq-len", "64", "--lr", "3e-3", "--device", "cpu", "--save-every", "0"]) == 0
    return {"root": root, "ckpt": ckpt, "adapter": root / "run" / "adapter"}


def _peft(ckpt, adapter):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def test_the_merged_checkpoint_is_peft_merge_and_loads_alone(run, capsys):
    import transformers

    out = run["root"] / "merged"
    assert main(["export", "--merge", "--model", str(run["ckpt"]), "--adapter", str(run["adapter"]),
                 "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["merged"] == str(out)
    assert not (run["root"] / "merged.partial").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    assert not any("lora" in k for k in merged.state_dict())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file()
    peft = _peft(run["ckpt"], run["adapter"])
    ids = torch.randint(0, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft(input_ids=ids).logits.float()
        with peft.disable_adapter():
            base = peft(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float()
    tol = LOGIT_ULPS * _bf16_ulp(float(want.abs().max()))
    diff = float((got - want).abs().max())
    assert diff <= tol, f"merged vs base + adapter under peft: max |diff| {diff} > {tol}"
    effect = float((want - base).abs().max())
    assert effect > 10 * tol, f"the adapter moves the logits by {effect}: too little to tell a merge from none"
    # the weights are peft's own merge_and_unload, bit for bit; control: one ulp off is caught
    expected = {k: v for k, v in peft.merge_and_unload().state_dict().items()}
    written = merged.state_dict()
    assert_all_equal("poros export --merge vs peft merge_and_unload", expected, written)
    key = next(k for k in written if "q_proj.weight" in k)
    nudged = {**written, key: written[key].clone()}
    nudged[key].view(-1).view(torch.int16)[0] += 1  # the next bf16 value
    with pytest.raises(pytest.fail.Exception):
        assert_all_equal("one ulp", expected, nudged)


def test_export_refuses_what_it_cannot_merge_in_one_line(run, tmp_path, capsys):
    argv = ["export", "--merge", "--model", str(run["ckpt"]), "--adapter", str(run["adapter"])]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    one_line_refusal(capsys, main([*argv, "--out", str(tmp_path / "full")]), "--out:", "not an empty folder")
    one_line_refusal(capsys, main([*argv[:-2], "--adapter", str(tmp_path), "--out", str(tmp_path / "o")]),
                     "not a peft adapter folder")
    other = tiny_checkpoint(tmp_path / "gemma", "tiny-gemma3", generated_texts(50))
    capsys.readouterr()  # what writing it printed
    one_line_refusal(capsys, main(["export", "--merge", "--model", str(other), "--adapter", str(run["adapter"]),
                                   "--out", str(tmp_path / "o")]), "does not have", "the checkpoint the run trained on")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    one_line_refusal(capsys, main(argv[:1] + argv[2:] + ["--out", str(tmp_path / "o")]), "give --merge")


def test_generate_continues_greedily_with_the_adapter(run, capsys):
    import transformers
    from peft import PeftModel

    from poros.finetune.data import load_tokenizer

    prompt = "The cat"
    assert main(["generate", "--model", str(run["ckpt"]), "--adapter", str(run["adapter"]), "--prompt", prompt,
                 "--max-new-tokens", "8", "--device", "cpu", "--bf16"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    # the same continuation, one argmax at a time
    tok = load_tokenizer(run["ckpt"])
    base = transformers.AutoModelForCausalLM.from_pretrained(str(run["ckpt"]), dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(base, str(run["adapter"])).eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            if nxt == tok.eos_token_id:
                break
    assert text == tok.decode(new), (text, tok.decode(new))
    # the NF4 base (as trained) runs too, and the base alone is a different model
    assert main(["generate", "--model", str(run["ckpt"]), "--adapter", str(run["adapter"]), "--prompt", prompt,
                 "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip()
    bare = shutil.copytree(run["adapter"], run["root"] / "zero-adapter")
    from safetensors.torch import load_file, save_file

    zeroed = {k: torch.zeros_like(v) if "lora_B" in k else v
              for k, v in load_file(str(bare / "adapter_model.safetensors")).items()}
    save_file(zeroed, str(bare / "adapter_model.safetensors"))
    assert main(["generate", "--model", str(run["ckpt"]), "--prompt", prompt, "--max-new-tokens", "8",
                 "--device", "cpu", "--bf16"]) == 0
    alone = capsys.readouterr().out.removesuffix("\n")
    assert main(["generate", "--model", str(run["ckpt"]), "--adapter", str(bare), "--prompt", prompt,
                 "--max-new-tokens", "8", "--device", "cpu", "--bf16"]) == 0
    assert capsys.readouterr().out.removesuffix("\n") == alone, "an adapter of zeros is the base"
