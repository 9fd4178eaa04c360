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
    assert not list(run["root"].glob(".merged.*partial"))
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
                                   "--out", str(tmp_path / "o")]), "adapts", "the checkpoint the run trained on")
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*partial"))
    one_line_refusal(capsys, main(argv[:1] + argv[2:] + ["--out", str(tmp_path / "o")]), "give --merge")


def test_generate_continues_greedily_with_the_adapter(run, capsys):
    import transformers
    from peft import PeftModel

    from poros.finetune.tokenizing import load_tokenizer

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
            if nxt == tok.eos_token_id:  # where generation stops; not printed
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
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


# --- an adapter only where it belongs --------------------------------------------------------------


def _run_copy(run, dst):
    """The run folder copied whole (its record beside the adapter), to change a file of it."""
    return shutil.copytree(run["root"] / "run", dst)


def test_an_adapter_of_another_base_is_refused_by_export_and_generate(run, tmp_path, capsys):
    """A base of the same shapes but other weights (another seed): both commands name the run's base and write
    nothing; the run's own base, in a copy of its folder, is taken (control)."""
    other = tiny_checkpoint(tmp_path / "other", "tiny-qwen2", generated_texts(120), seed=1)
    capsys.readouterr()
    out = tmp_path / "merged"
    one_line_refusal(capsys, main(["export", "--merge", "--model", str(other), "--adapter", str(run["adapter"]),
                                   "--out", str(out)]), "was trained on other weights than", str(run["ckpt"]))
    assert not out.exists() and not list(out.parent.glob(".merged.*partial"))
    one_line_refusal(capsys, main(["generate", "--model", str(other), "--adapter", str(run["adapter"]),
                                   "--prompt", "The cat", "--device", "cpu", "--bf16"]), "was trained on other weights")
    same = shutil.copytree(run["ckpt"], tmp_path / "same")
    assert main(["export", "--merge", "--model", str(same), "--adapter", str(run["adapter"]), "-o", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["merged"] == str(out)


def test_an_adapter_outside_its_run_is_checked_by_shapes_and_says_so(run, tmp_path, capsys):
    alone = shutil.copytree(run["adapter"], tmp_path / "adapter")
    assert main(["export", "--merge", "--model", str(run["ckpt"]), "--adapter", str(alone), "--out",
                 str(tmp_path / "m")]) == 0
    assert "is not inside its run folder (no RUN/config.json), so its base is checked by shapes only" in \
        capsys.readouterr().err


def test_the_tensors_rank_is_trusted_over_adapter_config(run, tmp_path, capsys):
    """A rank in adapter_config.json that the tensors do not have would scale the change by alpha/r wrongly:
    refused, as peft refuses to load it; the config as written merges (the first test)."""
    copy = _run_copy(run, tmp_path / "run")
    cfg_path = copy / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    for r in (cfg["r"] // 2, cfg["r"] * 2):
        cfg_path.write_text(json.dumps({**cfg, "r": r}))
        for argv in (["export", "--merge", "--out", str(tmp_path / "m")],
                     ["generate", "--prompt", "The cat", "--device", "cpu", "--bf16"]):
            one_line_refusal(capsys, main([*argv, "--model", str(run["ckpt"]), "--adapter", str(copy / "adapter")]),
                             f"says r {r}, but the adapter's tensors have rank {cfg['r']}")
    assert not (tmp_path / "m").exists()


def test_an_adapter_config_that_is_not_a_lora_adapters_says_what_it_lacks(run, tmp_path, capsys):
    """A config with no peft_type, another peft_type, or no object at all: named in one line, nothing written;
    the untouched copy exports (positive control)."""
    copy = _run_copy(run, tmp_path / "run")
    cfg_path = copy / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    argv = ["export", "--merge", "--model", str(run["ckpt"]), "--adapter", str(copy / "adapter")]
    for text, says in ((json.dumps({k: v for k, v in cfg.items() if k != "peft_type"}), "names no peft_type"),
                       (json.dumps({**cfg, "peft_type": "IA3"}), "a IA3 adapter"),
                       ("[1, 2]", "expected a JSON object")):
        cfg_path.write_text(text)
        one_line_refusal(capsys, main([*argv, "--out", str(tmp_path / "m")]), str(cfg_path), says)
        assert not (tmp_path / "m").exists()
    cfg_path.write_text(json.dumps(cfg))
    assert main([*argv, "--out", str(tmp_path / "m")]) == 0


def test_a_run_folder_as_adapter_says_what_to_pass(run, capsys):
    folder = run["root"] / "run"
    for argv in (["export", "--merge", "--out", str(run["root"] / "never")],
                 ["generate", "--prompt", "The cat", "--device", "cpu"]):
        one_line_refusal(capsys, main([*argv, "--model", str(run["ckpt"]), "--adapter", str(folder)]),
                         f"--adapter {folder} is a run folder; pass its adapter: --adapter {folder / 'adapter'}")
        one_line_refusal(capsys, main([*argv, "--model", str(run["ckpt"]), "--adapter", str(folder / "checkpoint")]),
                         f"--adapter {folder / 'checkpoint'} holds an adapter; pass it: --adapter "
                         f"{folder / 'checkpoint' / 'adapter'}")


def test_a_truncated_base_is_one_line_before_any_work(run, tmp_path, capsys):
    base = shutil.copytree(run["ckpt"], tmp_path / "base")
    shard = base / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    out = tmp_path / "m"
    one_line_refusal(capsys, main(["export", "--merge", "--model", str(base), "--adapter", str(run["adapter"]),
                                   "--out", str(out)]), f"{shard}: not a readable safetensors file")
    assert not out.exists() and not list(out.parent.glob(".m.*partial"))
    one_line_refusal(capsys, main(["generate", "--model", str(base), "--prompt", "The cat", "--device", "cpu"]),
                     f"{shard}: not a readable safetensors file")


# --- generate at its edges -----------------------------------------------------------------------


def _config_copy(run, dst, **changes):
    """The base with config.json changed (weights and tokenizer as they are); no generation_config.json."""
    base = shutil.copytree(run["ckpt"], dst)
    (base / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, **changes}))
    return base


def test_generate_refuses_prompts_it_cannot_continue(run, tmp_path, capsys):
    one_line_refusal(capsys, main(["generate", "--model", str(run["ckpt"]), "--prompt", "", "--device", "cpu"]),
                     "--prompt: '' is no tokens to continue")
    small = _config_copy(run, tmp_path / "small", vocab_size=8)  # the tokenizer's ids reach about 500
    one_line_refusal(capsys, main(["generate", "--model", str(small), "--prompt", "The cat", "--device", "cpu"]),
                     "beyond the model's 8 embeddings", "the tokenizer files do not belong to this checkpoint")
    short = _config_copy(run, tmp_path / "short", max_position_embeddings=4)
    one_line_refusal(capsys, main(["generate", "--model", str(short), "--prompt", "the cat sat on the mat by the "
                                   "window", "--device", "cpu"]), "reads at most 4 (max_position_embeddings)")


def test_generate_stops_at_the_tokenizers_end_of_sequence(run, tmp_path, capsys):
    """A base whose final norm is zero gives every token the same logit, so greedy decoding picks id 0, the
    tokenizer's end-of-sequence token, at once: generation stops there (its config names another
    end-of-sequence id, which transformers alone would wait for)."""
    from safetensors.torch import load_file, save_file

    from poros.finetune.tokenizing import load_tokenizer

    base = _config_copy(run, tmp_path / "eos", eos_token_id=5)
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    assert load_tokenizer(base).eos_token_id == 0
    assert main(["generate", "--model", str(base), "--prompt", "The cat", "--max-new-tokens", "6", "--device", "cpu",
                 "--bf16"]) == 0
    assert capsys.readouterr().out == "\n"


def test_generate_caps_new_tokens_at_the_models_positions(run, tmp_path, capsys):
    short = _config_copy(run, tmp_path / "short", max_position_embeddings=12)
    assert main(["generate", "--model", str(short), "--prompt", "The cat", "--max-new-tokens", "40",
                 "--device", "cpu", "--bf16"]) == 0
    err = capsys.readouterr().err
    assert "--max-new-tokens 40 capped at 10: the prompt's 2 tokens" in err, err
    assert main(["generate", "--model", str(short), "--prompt", "The cat", "--max-new-tokens", "10",
                 "--device", "cpu", "--bf16"]) == 0
    assert "capped" not in capsys.readouterr().err  # control: within the positions, nothing to say


def test_a_merge_past_the_file_size_limit_is_one_line_and_leaves_no_folder(run):
    """A real limit (RLIMIT_FSIZE in a process of its own): safetensors' own error about the shard it could not
    write becomes one line, and neither the merged folder nor its temporary remain; the control merges."""
    from tests.common.test_atomic import limited

    out = run["root"] / "merged-limited"
    code = f"""
        import sys
        from poros.cli import main
        sys.exit(main(["export", "--merge", "--model", {str(run["ckpt"])!r}, "--adapter", {str(run["adapter"])!r},
                       "--out", {str(out)!r}]))
    """
    done = limited(code, limit=16384)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == (
        f"poros export: error: cannot write the merged checkpoint {out} (File too large); raise the file-size limit "
        "(ulimit -f); nothing of it is left behind"), done.stderr
    assert not out.exists() and not list(run["root"].glob(".merged-limited.*"))
    control = limited(code, limit=None)
    assert control.returncode == 0 and (out / "config.json").is_file(), control.stderr[-2000:]
