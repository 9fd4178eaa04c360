"""`poros train` end to end on CPU: poros and resident end torch.equal, a resumed (or Ctrl-C'd and
resumed) run ends torch.equal to an uninterrupted one, the adapter loads with peft, and every bad
input is refused in one line. Each exactness check has a negative control."""

from __future__ import annotations

import csv
import json
import shlex
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import torch

import poros.finetune.recipe
import poros.finetune.data
import poros.finetune.loop
from poros.cli import main
from poros.finetune.samples import generated_chats, generated_texts, train_tokenizer, write_jsonl
from tests.capabilities import requires_bitsandbytes, requires_datasets
from tests.fixtures import one_line_refusal, tiny_checkpoint
from tests.store.test_build import assert_all_equal

pytestmark = requires_bitsandbytes

STEPS = 4
# seq 64 (bitsandbytes on CPU needs >= 64), two micro-batches a step, blocks of 2 of the 5 layers
RUN_ARGS = ["--seq-len", "64", "--grad-accum", "2", "--lr", "3e-3", "--block-size", "2", "--device", "cpu",
            "--save-every", "2"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny-qwen2 checkpoint with its tokenizer, training data (text and chats), eval data."""
    root = tmp_path_factory.mktemp("train")
    texts = generated_texts(150)
    ckpt = tiny_checkpoint(root / "ckpt", "tiny-qwen2", texts)
    data = write_jsonl(root / "data.jsonl", [{"text": t} for t in texts[:60]]
                       + [{"messages": m} for m in generated_chats(40)])
    evals = write_jsonl(root / "eval.jsonl", [{"text": t} for t in generated_texts(12, seed=9)])
    return {"root": root, "ckpt": ckpt, "data": data, "eval": evals}


def train(files, out, *extra, steps=STEPS, model=None, data=None) -> int:
    argv = ["train", "--model", str(model or files["ckpt"]), "--data", str(data or files["data"]), "--out", str(out),
            "--steps", str(steps), *RUN_ARGS, *extra]
    return main(argv)


def run_state(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor a run ends with: its LoRA weights and its AdamW state (checkpoint/)."""
    from safetensors.torch import load_file

    state = {f"adapter:{k}": v for k, v in load_file(str(out / "checkpoint/adapter/adapter_model.safetensors")).items()}
    opt = torch.load(out / "checkpoint/optimizer.pt", weights_only=True)["state"]
    for i, s in opt.items():
        state.update({f"adamw:{i}:{k}": v for k, v in s.items()})
    return state


def log_rows(out: Path) -> list[dict]:
    with (out / "log.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def reference(files):
    """The uninterrupted poros run everything else is compared with."""
    out = files["root"] / "reference"
    assert train(files, out) == 0
    return out


def assert_differs(what: str, expected, got) -> None:
    with pytest.raises(pytest.fail.Exception):
        assert_all_equal(what, expected, got)


# --- exactness -----------------------------------------------------------------------------------


def test_reference_run_writes_every_output(files, reference):
    ref = run_state(reference)
    assert len([k for k in ref if k.startswith("adapter:")]) == 5 * 7 * 2  # 5 layers x 7 linears x (A, B)
    moved = [k for k, v in ref.items() if ".lora_B." in k and bool(v.abs().sum() > 0)]
    assert moved, "training moved no lora_B weight"
    state = json.loads((reference / "checkpoint/state.json").read_text())
    assert state == {"step": STEPS, "position": STEPS * 2, "loss": state["loss"]}
    rows = log_rows(reference)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert all(float(r["loss"]) > 0 and float(r["tokens_per_s"]) > 0 and float(r["peak_memory_gb"]) > 0
               and float(r["lr"]) == 3e-3 for r in rows)
    assert (reference / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((reference / "config.json").read_text())
    assert config["settings"]["train"]["seq_len"] == 64 and config["settings"]["method"] == "poros"
    assert config["settings"]["model"] == str(files["ckpt"].resolve())
    assert len(config["fingerprints"]["data"]) == 64
    assert config["runs"][0]["from_step"] == 0 and "git" in config["runs"][0]["provenance"]
    # adapter/ is the final checkpoint's adapter
    final = Path(reference / "adapter/adapter_model.safetensors").read_bytes()
    assert final == (reference / "checkpoint/adapter/adapter_model.safetensors").read_bytes()


def test_poros_and_resident_end_equal(files, reference):
    resident = files["root"] / "resident"
    assert train(files, resident, "--method", "resident") == 0
    assert_all_equal("resident vs poros (tiny-qwen2)", run_state(reference), run_state(resident))
    assert [r["loss"] for r in log_rows(reference)] == [r["loss"] for r in log_rows(resident)]
    # negative controls: another seed ends elsewhere; a one-ulp change is caught
    other = files["root"] / "resident-seed1"
    assert train(files, other, "--method", "resident", "--seed", "1") == 0
    assert_differs("seed 1 vs seed 0", run_state(reference), run_state(other))
    nudged = run_state(resident)
    key = next(k for k in nudged if ".lora_B." in k)
    nudged[key] = nudged[key].clone()
    nudged[key].view(-1)[0] = torch.nextafter(nudged[key].view(-1)[0], torch.tensor(1.0))
    assert_differs("one ulp", run_state(reference), nudged)


def test_poros_and_resident_end_equal_for_a_tied_family(tmp_path):
    """tiny-gemma3: tied embeddings, sliding-window layers, chat-only data."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "tiny-gemma3", generated_texts(100))
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in generated_chats(60)])
    files = {"ckpt": ckpt, "data": data}
    assert train(files, tmp_path / "poros", steps=3) == 0
    assert train(files, tmp_path / "resident", "--method", "resident", steps=3) == 0
    a, b = run_state(tmp_path / "poros"), run_state(tmp_path / "resident")
    assert_all_equal("resident vs poros (tiny-gemma3)", a, b)
    assert_differs("poros step 3 vs its initial adapter", a, {k: v for k, v in a.items()} | {
        k: torch.zeros_like(v) for k, v in a.items() if ".lora_B." in k})


def _resume_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resume_ends_equal_to_an_uninterrupted_run(files, reference, monkeypatch):
    part = files["root"] / "part"
    assert train(files, part, steps=2) == 0
    other_method = _resume_copy(part, files["root"] / "part-resident")
    shifted = _resume_copy(part, files["root"] / "part-shifted")
    nudged = _resume_copy(part, files["root"] / "part-nudged")

    with (part / "log.csv").open("a") as f:  # a step logged after the last checkpoint, then killed
        f.write("3,9.999,0.003,1.0,1.0,\n")
    assert train(files, part, "--resume") == 0
    assert_all_equal("resumed at 2 vs uninterrupted", run_state(reference), run_state(part))
    rows = log_rows(part)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in log_rows(reference)]
    runs = json.loads((part / "config.json").read_text())["runs"]
    assert [r["from_step"] for r in runs] == [0, 2]

    # the method may change on resume: resident continues a poros run exactly
    assert train(files, other_method, "--resume", "--method", "resident") == 0
    assert_all_equal("poros 2 + resident 2 vs poros 4", run_state(reference), run_state(other_method))

    # negative control 1: resuming one sequence off in the data ends elsewhere
    real = poros.finetune.data.PackedData.batches_at
    monkeypatch.setattr(poros.finetune.data.PackedData, "batches_at", lambda self, pos, b, a: real(self, pos + 1, b, a))
    assert train(files, shifted, "--resume") == 0
    monkeypatch.undo()
    assert_differs("resumed one sequence off", run_state(reference), run_state(shifted))

    # negative control 2: a checkpoint adapter off by one ulp ends elsewhere
    from safetensors.torch import load_file, save_file

    path = nudged / "checkpoint/adapter/adapter_model.safetensors"
    tensors = load_file(str(path))
    key = next(k for k in tensors if ".lora_A." in k)
    tensors[key].view(-1)[0] = torch.nextafter(tensors[key].view(-1)[0], torch.tensor(1.0))
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert train(files, nudged, "--resume") == 0
    assert_differs("resumed from a nudged adapter", run_state(reference), run_state(nudged))


@pytest.mark.parametrize("signum,said", [(signal.SIGINT, "Ctrl-C: saving"), (signal.SIGTERM, "SIGTERM: saving")],
                         ids=["signal=SIGINT", "signal=SIGTERM"])
def test_ctrl_c_saves_a_checkpoint_and_prints_the_resume_command(files, reference, monkeypatch, capsys, signum,
                                                                 said):
    """Ctrl-C, and SIGTERM (what schedulers and preemption send), stop after the step they arrive in."""
    real = poros.finetune.recipe.finetune

    def interrupted(*args, **kwargs):
        return real(*args, **kwargs, on_step=lambda step: step == 2 and signal.raise_signal(signum))

    monkeypatch.setattr(poros.finetune.recipe, "finetune", interrupted)  # what `poros train` imports as it runs
    out = files["root"] / f"stopped-{signum.name}"
    assert train(files, out, "--save-every", "0") == 128 + signum
    err = capsys.readouterr().err
    assert said in err
    assert json.loads((out / "checkpoint/state.json").read_text())["step"] == 2
    assert not (out / "adapter").exists(), "adapter/ is the finished run's"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the Ctrl-C handler is removed"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the SIGTERM handler is removed"
    lines = err.splitlines()
    command = lines[lines.index(next(l for l in lines if l.endswith("resume with:"))) + 1].strip()
    argv = shlex.split(command)
    assert argv[:2] == ["poros", "train"] and argv[-1] == "--resume"
    monkeypatch.undo()
    assert main(argv[1:]) == 0
    assert_all_equal("Ctrl-C at 2, resumed vs uninterrupted", run_state(reference), run_state(out))
    assert (out / "adapter/adapter_model.safetensors").is_file()


def test_a_second_ctrl_c_after_the_checkpoint_is_saved_is_no_traceback(files, monkeypatch, capsys):
    """The second Ctrl-C lands wherever the run is, here in a finalizer that garbage collection runs as the
    stop's checkpoint is saved: Python would print "Exception ignored ..." with a traceback and lose it. It is
    ignored: the run stops as the first asked, with its checkpoint and one resume line."""
    import gc
    import sys

    real_plot, real_finetune, unraisable = poros.finetune.loop.plot_loss, poros.finetune.recipe.finetune, []

    class Finalized:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    def plot_then_ctrl_c(*args, **kwargs):  # loss.png is drawn once the checkpoint is saved
        real_plot(*args, **kwargs)
        Finalized()  # dropped at once: its finalizer takes the second Ctrl-C
        gc.collect()

    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(poros.finetune.loop, "plot_loss", plot_then_ctrl_c)
    monkeypatch.setattr(poros.finetune.recipe, "finetune", lambda *a, **k: real_finetune(
        *a, **k, on_step=lambda step: step == 2 and signal.raise_signal(signal.SIGINT)))
    out = files["root"] / "stopped-twice"
    assert train(files, out, "--save-every", "0") == 130
    err = capsys.readouterr().err
    assert unraisable == [] and "Traceback" not in err and "Exception ignored" not in err, (unraisable, err)
    assert err.strip().splitlines()[-1].strip().endswith("--resume"), err
    assert json.loads((out / "checkpoint/state.json").read_text())["step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "the Ctrl-C handler is put back"


def test_eval_data_is_scored_at_save_points_and_changes_nothing(files, reference):
    out = files["root"] / "eval"
    assert train(files, out, "--eval-data", str(files["eval"])) == 0
    assert_all_equal("with --eval-data vs without", run_state(reference), run_state(out))
    rows = log_rows(out)
    scored = [int(r["step"]) for r in rows if r["eval_loss"]]
    assert scored == [2, 4]
    assert all(0 < float(r["eval_loss"]) < 20 for r in rows if r["eval_loss"])


def test_the_loss_falls(files):
    out = files["root"] / "falls"
    assert train(files, out, "--method", "resident", "--save-every", "0", steps=16) == 0
    losses = [float(r["loss"]) for r in log_rows(out)]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.2, f"loss did not fall: first four {losses[:4]}, last four {losses[-4:]}"


# --- the adapter in peft -------------------------------------------------------------------------


def _load_with_peft(ckpt: Path, adapter: Path):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter))
    return model, [str(w.message) for w in caught if "adapter keys" in str(w.message)]


def test_adapter_loads_in_peft_with_no_missing_or_unexpected_keys(files, reference):
    from safetensors.torch import load_file, save_file

    adapter = reference / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(files["ckpt"].resolve())
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["peft_type"] == "LORA"
    model, missing_warnings = _load_with_peft(files["ckpt"], adapter)
    assert missing_warnings == []
    result = model.load_adapter(str(adapter), adapter_name="again")
    assert result.missing_keys == [] and result.unexpected_keys == []
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    live = {n.replace(".default.", "."): p for n, p in model.named_parameters() if ".default." in n}
    assert sorted(live) == sorted(saved)
    assert_all_equal("adapter loaded by peft", saved, {k: p.detach() for k, p in live.items()})
    # negative control: an adapter missing one tensor is reported by the same check
    broken = files["root"] / "broken-adapter"
    shutil.copytree(adapter, broken)
    save_file({k: v for i, (k, v) in enumerate(saved.items()) if i}, str(broken / "adapter_model.safetensors"))
    _, missing_warnings = _load_with_peft(files["ckpt"], broken)
    assert missing_warnings, "peft did not report the missing tensor"


# --- an NF4 checkpoint as the model --------------------------------------------------------------


def _with_tokenizer(folder: Path, ckpt: Path) -> Path:
    for f in folder.glob("tokenizer*"):
        f.unlink()
    for f in ckpt.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, folder / f.name)
    return folder


def test_training_from_a_poros_nf4_export_equals_training_from_bf16(files, reference):
    """export_bnb4bit writes the very NF4 bytes a bf16 build makes, so the run is the same run."""
    from poros.store.build import build_store
    from poros.store.export import export_bnb4bit

    store, _ = build_store(str(files["ckpt"]), progress=False)
    export = _with_tokenizer(export_bnb4bit(store, files["root"] / "nf4-export"), files["ckpt"])
    out = files["root"] / "from-nf4"
    assert train(files, out, model=export) == 0
    assert_all_equal("from the NF4 export vs from bf16", run_state(reference), run_state(out))


def test_training_from_a_double_quantized_transformers_checkpoint(files):
    import transformers

    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(files["ckpt"]), quantization_config=q,
                                                              device_map="cpu")
    folder = files["root"] / "nf4-dq"
    model.save_pretrained(str(folder))
    _with_tokenizer(folder, files["ckpt"])
    assert train(files, files["root"] / "dq-poros", model=folder, steps=2) == 0
    assert train(files, files["root"] / "dq-resident", "--method", "resident", model=folder, steps=2) == 0
    assert_all_equal("resident vs poros (double-quantized NF4 checkpoint)", run_state(files["root"] / "dq-poros"),
                     run_state(files["root"] / "dq-resident"))
    _, missing = _load_with_peft(folder, files["root"] / "dq-poros/adapter")
    assert missing == []


# --- bad input: one line each, exit 2 ------------------------------------------------------------


_refused = one_line_refusal


@pytest.mark.parametrize(
    "content,named",
    [("", ["data.jsonl", "empty"]),
     ('{"text": "a b c"}\n{"text": oops}\n', ["data.jsonl:2", "not JSON"]),
     ('{"text": "a b c"}\n{"prompt": "a"}\n', ["data.jsonl:2", '"text", "messages", or "prompt" and "completion"',
                                              "got keys ['prompt']"]),
     ('{"text": "the cat sat"}\n', ["tokens after tokenization", "--seq-len 64"])],
    ids=["data=empty", "data=not-json", "data=neither-text-nor-messages", "data=shorter-than-a-sequence"],
)
def test_bad_data_is_refused_in_one_line(files, tmp_path, capsys, content, named):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    _refused(capsys, train(files, tmp_path / "run", data=data), *named)
    assert not (tmp_path / "run").exists(), "nothing is written for a refused run"


@pytest.fixture
def within_a_minute():
    """A test that would hang on a blocking read ends instead, with TimeoutError."""
    def give_up(signum, frame):
        raise TimeoutError("still blocked after 60 s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("flag", ["--data", "--eval-data", "--out", "--config", "--model"])
@pytest.mark.parametrize("kind", ["fifo", "symlink-loop"])
def test_paths_that_are_no_file_are_one_line_before_any_read(files, tmp_path, capsys, within_a_minute, flag, kind):
    """A FIFO with no writer would block the first read forever; a loop of symbolic links ends path resolution
    in a traceback. Both are named with the flag that gave them, and nothing is written."""
    import os

    bad = tmp_path / "bad"
    if kind == "fifo":
        os.mkfifo(bad)
    else:
        os.symlink(tmp_path / "loop", bad)
        os.symlink(bad, tmp_path / "loop")
    out = tmp_path / "run"
    argv = ["train", *(["--config", str(bad)] if flag == "--config" else []), "--model",
            str(bad if flag == "--model" else files["ckpt"]), "--data", str(bad if flag == "--data" else files["data"]),
            "--out", str(bad if flag == "--out" else out), "--steps", "2", *RUN_ARGS,
            *(["--eval-data", str(bad)] if flag == "--eval-data" else [])]
    why = "a FIFO (named pipe), not a file" if kind == "fifo" else "a loop of symbolic links"
    _refused(capsys, main(argv), str(bad), why)
    assert not out.exists()


def test_messages_need_a_chat_template(files, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(files["ckpt"], folder)
    for f in folder.glob("*"):
        if f.name.startswith(("tokenizer", "chat_template")):
            f.unlink()
    train_tokenizer(folder, generated_texts(50), chat_template=False)
    _refused(capsys, train(files, tmp_path / "run", model=folder), "data.jsonl:61:", "no chat template")


def test_a_model_folder_without_tokenizer_files(files, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in files["ckpt"].glob("*"):
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, folder / f.name)
    _refused(capsys, train(files, tmp_path / "run", model=folder), str(folder), "no tokenizer files")


def test_a_registered_shape_is_not_a_checkpoint(files, tmp_path, capsys):
    _refused(capsys, train(files, tmp_path / "run", model="tiny-qwen2"), "--model: tiny-qwen2", "checkpoint folder")


def test_an_output_folder_holding_another_run(files, reference, tmp_path, capsys):
    before = (reference / "config.json").read_text()
    _refused(capsys, train(files, reference), f"--out: {reference} holds another run", "--resume")
    (tmp_path / "notes.txt").write_text("mine")
    _refused(capsys, train(files, tmp_path), str(tmp_path), "not an empty folder")
    assert (reference / "config.json").read_text() == before


def test_resume_refuses_settings_that_change_the_result(files, reference, tmp_path, capsys):
    before = (reference / "config.json").read_text()
    code = train(files, reference, "--resume", "--lr", "1e-3", "--seed", "2", steps=STEPS + 2)
    _refused(capsys, code, "--resume: settings differ", "lr 0.003 (now 0.001)", "seed 0 (now 2)")
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": t} for t in generated_texts(80, seed=1)])
    _refused(capsys, train(files, reference, "--resume", data=other, steps=STEPS + 2), f"data {other.resolve()}")
    assert (reference / "config.json").read_text() == before
    _refused(capsys, train(files, reference, "--resume"), f"--steps: the run in {reference} is already at step {STEPS}")
    _refused(capsys, train(files, tmp_path / "none", "--resume"), "--resume:", "holds no run")


def test_schedule_settings_change_nothing_and_may_change_on_resume(files, reference):
    """--vram-budget (a plan that keeps 2 of the 5 layers resident), --block-size and the accumulation order
    are schedule settings: a run with them, and a run resumed with others, end equal to the reference."""
    out = files["root"] / "budget"
    assert train(files, out, "--vram-budget", "4.4MB", "--accumulation", "micro", steps=2) == 0
    first = json.loads((out / "config.json").read_text())["settings"]["train"]
    assert first["vram_budget"] == 4_400_000 and first["accumulation"] == "micro"
    assert train(files, out, "--resume", "--block-size", "1", "--no-overlap-backward") == 0
    assert_all_equal("other schedules vs the reference", run_state(reference), run_state(out))
    runs = json.loads((out / "config.json").read_text())["runs"]
    assert [r["from_step"] for r in runs] == [0, 2]
    config = json.loads((out / "config.json").read_text())["settings"]["train"]
    assert config["block_size"] == 1 and config["vram_budget"] is None


def test_eval_data_shorter_than_one_batch_is_refused(files, tmp_path, capsys):
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"text": " ".join(generated_texts(8, seed=2))}])
    code = train(files, tmp_path / "run", "--eval-data", str(evals), "--batch-size", "4")
    _refused(capsys, code, f"--eval-data: {evals} holds fewer sequences", "--batch-size 4 x --grad-accum 2")


def test_a_non_finite_loss_stops_the_run(files, tmp_path, capsys, monkeypatch):
    import poros.engine.methods.registry
    from poros.engine.methods.trainer import StepResult

    real = poros.engine.methods.registry.make_trainer

    def diverging(method, store, cfg, world=None):
        trainer = real(method, store, cfg, world)
        step = trainer.step
        trainer.step = lambda batches: StepResult(float("nan"), step(batches).seconds)
        return trainer

    monkeypatch.setattr(poros.finetune.recipe, "make_trainer", diverging)
    assert train(files, tmp_path / "run", steps=2) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "poros train: error: step 1: the loss is nan; lower --lr (now 0.003) and start a new run"
    assert not (tmp_path / "run/checkpoint").exists(), "a diverged step is not saved"


def test_bad_schedule_settings_are_listed_at_once(files, tmp_path, capsys):
    code = train(files, tmp_path / "run", "--save-every", "-1", steps=0)
    _refused(capsys, code, "steps: expected an integer > 0, got 0", "save_every: expected an integer >= 0")


def train_ranks(files, out, *extra, steps=STEPS, ranks=2) -> dict:
    """`torchrun --nproc-per-node RANKS -m poros train ...` (gloo on the CPU); rank 0's summary line."""
    import subprocess

    from poros.harness.ranks import launch_env, torchrun

    cmd = torchrun(ranks) + ["-m", "poros", "train", "--model", str(files["ckpt"]), "--data", str(files["data"]),
                             "--out", str(out), "--steps", str(steps), *RUN_ARGS, *extra]
    proc = subprocess.run(cmd, env=launch_env(ranks), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone reports
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def two_ranks(files):
    """A poros run on two ranks (its folder's parent holds the other two-rank runs)."""
    root = files["root"] / "ranks"
    summary = train_ranks(files, root / "poros")
    assert summary["step"] == STEPS and summary["adapter"]
    return root


@pytest.mark.slow  # two gloo ranks under torchrun, twice
def test_data_parallel_training_is_exact_and_resumes_exactly(files, reference, two_ranks):
    """Two ranks: poros and resident (under DistributedDataParallel) end equal; stopped at step 2 and
    resumed on two ranks, equal to the uninterrupted run; the run records its ranks. Negative control:
    two ranks (twice the data a step, gradients averaged) end unlike the one-process reference."""
    root = two_ranks
    train_ranks(files, root / "resident", "--method", "resident")
    assert_all_equal("poros vs resident on two ranks", run_state(root / "poros"), run_state(root / "resident"))
    train_ranks(files, root / "resumed", steps=2)
    train_ranks(files, root / "resumed", "--resume")
    assert_all_equal("resumed vs uninterrupted on two ranks", run_state(root / "poros"), run_state(root / "resumed"))
    config = json.loads((root / "poros" / "config.json").read_text())
    assert config["settings"]["train"]["gpus"] == 2
    state = json.loads((root / "poros" / "checkpoint" / "state.json").read_text())
    assert state["position"] == STEPS * 2 * 2  # steps x ranks x grad_accum sequences
    assert_differs("two ranks vs one process", run_state(reference), run_state(root / "poros"))
    assert len(log_rows(root / "poros")) == STEPS  # one writer: no row twice


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_gpus_starts_the_ranks_itself(files, two_ranks, capfd):
    """`poros train --gpus 2` runs what `torchrun --nproc-per-node 2 -m poros train` runs: the same bits,
    one summary line, gpus 2 in the resolved configuration."""
    out = two_ranks / "by-gpus"
    assert train(files, out, "--gpus", "2") == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["step"] == STEPS
    assert_all_equal("--gpus 2 vs torchrun on two ranks", run_state(two_ranks / "poros"), run_state(out))
    from poros.finetune.config import read_run_file

    assert read_run_file(out / "run.yaml")["gpus"] == 2


def test_more_ranks_than_the_host_takes_are_refused_before_any_starts(files, tmp_path, capsys, monkeypatch):
    """`poros train --gpus 64` on a two-core machine: one line, no rank started, no run folder (the limit itself
    is held to a count that runs in tests/harness/test_preflight.py)."""
    import subprocess

    import poros.harness.preflight

    def no_process(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(poros.harness.preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    code = train(files, tmp_path / "run", "--gpus", "64")
    one_line_refusal(capsys, code, "poros train: error: gpus: 64 data-parallel ranks on the CPU", "2 CPU core(s)",
                     "set gpus to 8 or less")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # a poros run on two gloo ranks under torchrun (the module's ranks)
def test_resuming_with_another_number_of_ranks_is_refused(files, two_ranks, capsys):
    out = two_ranks / "poros"
    assert train(files, out, "--resume", steps=STEPS + 2) == 2
    err = capsys.readouterr().err
    assert "would change its result" in err and "gpus 2 (now 1)" in err


# --- refused before work, and never saved non-finite -------------------------------------------------


@pytest.mark.parametrize("flags,named", [
    (["--lr", "inf"], "lr: expected a finite number > 0, got inf"),
    (["--lr", "nan"], "lr: expected a finite number > 0, got nan"),
    (["--seed", str(2**70)], "seed: expected an integer from 0 to 4294967295"),
    (["--seed", "-1"], "seed: expected an integer from 0 to 4294967295 (2**32 - 1), got -1"),
    (["--lora-rank", str(2**40)], "lora_rank: expected an integer > 0 and at most 2147483647"),
    (["--seq-len", "1"], "seq_len: expected an integer >= 2 (a sequence of one token has no next token to learn)"),
    (["--warmup-steps", str(STEPS)], f"warmup_steps: expected fewer than steps ({STEPS}), got {STEPS}: the run"),
    (["--warmup-steps", str(STEPS), "--lr-schedule", "cosine"], f"warmup_steps: expected fewer than steps ({STEPS})"),
    (["--batch-size", "1000"], "fewer than one step takes (--batch-size 1000 x --grad-accum 2 = 2000), so a step "
                               "would repeat sequences"),
], ids=["lr=inf", "lr=nan", "seed=2**70", "seed=-1", "lora-rank=2**40", "seq-len=1", "warmup=steps",
        "warmup=steps-cosine", "batch-beyond-data"])
def test_settings_no_run_can_take_are_refused_before_work(files, tmp_path, capsys, flags, named):
    _refused(capsys, train(files, tmp_path / "run", *flags), named)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_is_never_written_with_non_finite_state(files, tmp_path, capsys, monkeypatch):
    import poros.engine.methods.registry

    real = poros.engine.methods.registry.make_trainer

    def blowing_up(method, store, cfg, world=None):
        trainer = real(method, store, cfg, world)
        step = trainer.step

        def stepped(batches):
            result = step(batches)
            if trainer.steps_done == 4:  # the update of step 4 leaves an inf (the loss came before it)
                with torch.no_grad():
                    trainer.params[3][1].view(-1)[0] = float("inf")
            return result
        trainer.step = stepped
        return trainer

    monkeypatch.setattr(poros.finetune.recipe, "make_trainer", blowing_up)
    out = tmp_path / "run"
    code = train(files, out, steps=4)
    line = _refused_last(capsys, code)
    assert line.startswith("poros train: error: step 4: ") and "holds NaN/inf after the update" in line, line
    assert "the checkpoint of step 2 is kept" in line
    assert json.loads((out / "checkpoint/state.json").read_text())["step"] == 2
    saved = run_state(out)
    assert all(bool(torch.isfinite(v).all()) for v in saved.values())
    assert not (out / "adapter").exists()


def _refused_last(capsys, code) -> str:
    """Exit 2 and the last line of stderr (a run that started prints its progress before the refusal)."""
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    return err.strip().splitlines()[-1]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(files, reference, tmp_path, capsys, monkeypatch):
    import errno

    real, calls = torch.save, []

    def filling(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 3:  # the optimizer state of the second checkpoint (step 4)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling)
    out = tmp_path / "run"
    line = _refused_last(capsys, train(files, out))
    monkeypatch.undo()
    assert line.startswith(f"poros train: error: step 4: writing into {out} failed (No space left on device); "
                           "the checkpoint of step 2 is intact; free space, then resume with: "), line
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint"]
    assert json.loads((out / "checkpoint/state.json").read_text())["step"] == 2
    assert train(files, out, "--resume") == 0  # the intact checkpoint resumes to the reference's end
    assert_all_equal("resumed after a full disk vs uninterrupted", run_state(reference), run_state(out))


def _files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage,named", [
    (lambda c: _truncate(c / "optimizer.pt"), "checkpoint/optimizer.pt: truncated"),
    (lambda c: (c / "state.json").write_text("{garbage"), "checkpoint/state.json: not readable JSON"),
    (lambda c: (c / "state.json").write_text('{"step": "four"}'), "checkpoint/state.json: expected an object"),
    (lambda c: (c / "adapter" / "adapter_model.safetensors").unlink(),
     "checkpoint/adapter/adapter_model.safetensors: missing"),
    (lambda c: _truncate(c / "adapter" / "adapter_model.safetensors"),
     "checkpoint/adapter/adapter_model.safetensors: not a readable safetensors file"),
    (lambda c: (c.parent / "config.json").write_text("[]"), "config.json: expected the run's settings"),
], ids=["optimizer-truncated", "state-garbage", "state-no-step", "adapter-missing", "adapter-truncated",
        "record-garbage"])
def test_a_damaged_checkpoint_is_named_and_nothing_is_touched(files, reference, tmp_path, capsys, damage, named):
    run = _resume_copy(reference, tmp_path / "run")
    damage(run / "checkpoint")
    before = _files_of(run)
    capsys.readouterr()
    line = _refused(capsys, train(files, run, "--resume", steps=STEPS + 2), named)
    assert "start again in a new --out" in line, line
    assert _files_of(run) == before  # nothing touched, nothing written


def test_a_damaged_checkpoint_names_the_previous_one_where_it_is_kept(files, reference, tmp_path, capsys):
    """A save cut off after its swap leaves checkpoint.old beside the new checkpoint: where the new one is
    damaged, the line says how to resume from the old one; that done, the run resumes (control)."""
    run = _resume_copy(reference, tmp_path / "run")
    shutil.copytree(run / "checkpoint", run / "checkpoint.old")
    (run / "checkpoint" / "rng.pt").unlink()
    capsys.readouterr()
    _refused(capsys, train(files, run, "--resume", steps=STEPS + 1), "checkpoint/rng.pt: missing",
             f"the previous checkpoint (step {STEPS}) is kept in {run / 'checkpoint.old'}")
    shutil.move(run / "checkpoint", tmp_path / "damaged")
    (run / "checkpoint.old").rename(run / "checkpoint")
    assert train(files, run, "--resume", steps=STEPS + 1) == 0


def test_resume_on_another_base_of_the_same_shapes_is_refused(files, reference, tmp_path, capsys):
    other = tiny_checkpoint(tmp_path / "other", "tiny-qwen2", generated_texts(150), seed=1)
    assert (other / "config.json").read_bytes() == (files["ckpt"] / "config.json").read_bytes()
    assert poros.finetune.recipe.model_fingerprint(other) == poros.finetune.recipe.model_fingerprint(files["ckpt"])
    run = _resume_copy(reference, tmp_path / "run")
    capsys.readouterr()  # what saving the checkpoint printed
    code = train(files, run, "--resume", model=other, steps=STEPS + 2)
    _refused(capsys, code, "--resume: settings differ", f"model {other.resolve()} (other weights than the run's base")
    # control: the same weights in another folder resume
    same = Path(shutil.copytree(files["ckpt"], tmp_path / "same"))
    assert train(files, run, "--resume", model=same, steps=STEPS + 1) == 0


# --- what the run says, and which modules train ----------------------------------------------------


def test_the_run_says_what_it_takes_from_the_data_and_where_adapters_go(files, tmp_path, capsys):
    mixed = [{"text": t} for t in generated_texts(40)]
    for m in generated_chats(30):
        mixed.append({"messages": [{**x, "role": {"assistant": "gpt", "user": "human"}.get(x["role"], x["role"])}
                                   for x in m]})
    data = write_jsonl(tmp_path / "mixed.jsonl", mixed)
    assert train(files, tmp_path / "run", data=data, steps=1) == 0
    err = capsys.readouterr().err
    line = next(l for l in err.splitlines() if l.startswith(str(data)))
    assert ": 70 records (40 text, 30 chat); " in line and "learned" in line, line
    assert "roles mapped: 'gpt' -> assistant" in line and "'human' -> user" in line, line
    assert ("LoRA adapters on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (rank 16)" in err), err


def _tiny_phi3(folder: Path) -> Path:
    """A Phi-3 style checkpoint (fused qkv_proj and gate_up_proj) with a tokenizer."""
    import transformers

    tok = train_tokenizer(folder, generated_texts(150))
    config = transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                     bos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(str(folder))
    return folder


def test_fused_projections_carry_adapters_exactly(files, tmp_path, capsys):
    ckpt = _tiny_phi3(tmp_path / "phi3")
    assert train(files, tmp_path / "poros", model=ckpt, steps=2) == 0
    err = capsys.readouterr().err
    assert "LoRA adapters on o_proj, qkv_proj, gate_up_proj, down_proj (rank 16)" in err, err
    state = run_state(tmp_path / "poros")
    for name in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
        assert sum(f".{name}.lora_B." in k for k in state) == 3, name
    targets = json.loads((tmp_path / "poros/config.json").read_text())["settings"]["train"]["lora_targets"]
    assert "qkv_proj" in targets and "gate_up_proj" in targets
    assert train(files, tmp_path / "resident", "--method", "resident", model=ckpt, steps=2) == 0
    assert_all_equal("resident vs poros (Phi-3 style)", state, run_state(tmp_path / "resident"))
    # lora_targets names them; naming the parts of a fused linear is refused by name
    assert train(files, tmp_path / "qkv", "--lora-targets", "qkv_proj", model=ckpt, steps=1) == 0
    assert {k.split(".")[-3] for k in run_state(tmp_path / "qkv") if k.startswith("adapter:")} == {"qkv_proj"}
    capsys.readouterr()
    _refused(capsys, train(files, tmp_path / "q", "--lora-targets", "q_proj,v_proj", model=ckpt, steps=1),
             "lora_targets:", "fuses q_proj, k_proj, v_proj into qkv_proj: name qkv_proj")


def test_a_config_field_of_the_wrong_type_is_one_line(files, tmp_path, capsys):
    folder = Path(shutil.copytree(files["ckpt"], tmp_path / "ckpt"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    named = (f"{folder}/config.json: num_hidden_layers is \"2\" (str), expected an integer",)
    _refused(capsys, train(files, tmp_path / "run", model=folder), *named)
    _refused(capsys, main(["plan", "--model", str(folder)]), *named)
    assert not (tmp_path / "run").exists()


def test_data_that_is_not_utf8_or_is_gzip_compressed(files, tmp_path, capsys):
    import gzip

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(files["data"].read_bytes() + '{"text": "déjà vu"}\n'.encode("latin-1"))
    _refused(capsys, train(files, tmp_path / "run", data=bad), f"{bad}:101: not UTF-8 text")
    _refused(capsys, train(files, tmp_path / "run", "--eval-data", str(bad)), f"{bad}:101: not UTF-8 text")
    packed = tmp_path / "data.jsonl.gz"
    packed.write_bytes(gzip.compress(files["data"].read_bytes()))
    assert train(files, tmp_path / "gz", "--eval-data", str(packed), data=packed, steps=1) == 0


# --- the run file, the resolved configuration and the dry run ---------------------------------------


def test_a_run_file_is_the_same_run_and_the_run_folder_keeps_it(files, reference, tmp_path, capsys):
    from poros.finetune.config import read_run_file

    out = tmp_path / "run"
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"model: {files['ckpt']}\ndata: {files['data']}\nout: {out}\nsteps: 4\nseq_len: 64\n"
                        "grad_accum: 2\nlr: 3e-3\nblock_size: 2\nsave_every: 1\n")
    assert main(["train", "--config", str(run_file), "save_every=2", "--device", "cpu"]) == 0
    assert_all_equal("run file vs flags", run_state(reference), run_state(out))
    saved = read_run_file(out / "run.yaml")
    assert saved["lr"] == 3e-3 and saved["save_every"] == 2 and saved["device"] == "cpu"
    assert saved["model"] == str(files["ckpt"].resolve()) and saved["steps"] == 4
    capsys.readouterr()
    # resuming from it with a changed computed setting is refused by name; nothing is written
    before = (out / "config.json").read_text()
    code = main(["train", "--config", str(out / "run.yaml"), "--resume", "steps=6", "lr=1e-3", "lora_rank=8"])
    _refused(capsys, code, "--resume: settings differ", "lr 0.003 (now 0.001)", "lora_rank 16 (now 8)")
    assert (out / "config.json").read_text() == before
    code = main(["train", "--config", str(run_file), "learning_rate=1e-3"])
    _refused(capsys, code, "learning_rate: not a setting of poros train (did you mean lr?)")


def test_a_dry_run_prints_plan_and_data_and_writes_nothing(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(files, out, "--dry-run") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "plan: poros on cpu; attention default; 5 layers: 0 resident, 5 streamed in blocks of 2, " \
                       "predicted peak 4.27 MB; eager layers; defaults for cpu: overlap_backward (set one to change " \
                       "it)", lines  # the CPU runs the backward serially: one layer's transient, not two
    assert lines[1].startswith(f"{files['data']}: 100 records (60 text, 40 chat); ") and "sequences of 64" in lines[1]
    assert lines[2].startswith("steps 1-4: 2 sequences of 64 tokens a step")
    assert len(lines) == 3 and not out.exists()


def test_a_dry_run_for_cuda_shows_the_fast_path_it_would_take(files, tmp_path, capsys, monkeypatch):
    """The choice on a GPU, made on the CPU: no schedule flags, a device with 100 GB free."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # restored after: deterministic sets it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * 10**9, 141 * 10**9))
    argv = ["train", "--model", str(files["ckpt"]), "--data", str(files["data"]), "--out", str(tmp_path / "run"),
            "--steps", "10", "--seq-len", "64", "--dry-run"]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("plan: poros on cuda; attention fast (deterministic); 5 layers: 5 resident, 0 streamed"), line
    assert "(budget auto: 97.2 GB)" in line and "; CUDA-graph layers; " in line  # 100 GB free less 2% of 141 GB
    assert "5 resident, 0 streamed" in line and "; activations kept in 5 of them (no recompute); " in line
    assert line.endswith("defaults for cuda: attention, deterministic, vram_budget, cuda_graphs, keep_activations, "
                         "placement (set one to change it)")


# --- more data forms -------------------------------------------------------------------------------


def test_an_eval_split_is_scored_and_equals_training_without_its_records(files, reference, tmp_path, capsys):
    from poros.finetune.data import held_out, read_records

    out = tmp_path / "split"
    assert train(files, out, "--eval-split", "0.2") == 0
    assert [int(r["step"]) for r in log_rows(out) if r["eval_loss"]] == [2, 4]
    assert json.loads((out / "config.json").read_text())["settings"]["eval_split"] == 0.2
    # the run is the run on the file less the held-out records: they are never trained on
    kept = [r for i, r in enumerate(read_records(files["data"])) if not held_out(0, i, 0.2)]
    assert 60 <= len(kept) < 100
    rest = train(files, tmp_path / "rest", data=write_jsonl(tmp_path / "rest.jsonl", kept))
    assert rest == 0
    assert_all_equal("eval split vs the file less its held-out records", run_state(tmp_path / "rest"),
                     run_state(out))
    assert_differs("eval split vs the whole file", run_state(reference), run_state(out))
    capsys.readouterr()
    _refused(capsys, train(files, out, "--resume", "--eval-split", "0.1", steps=6), "eval_split 0.2 (now 0.1)")
    _refused(capsys, train(files, tmp_path / "both", "--eval-split", "0.1", "--eval-data", str(files["eval"])),
             "eval_split: takes the eval records from the training data, so it goes without eval_data")


@requires_datasets
def test_prompt_completion_records_in_parquet_train_as_in_json_lines(files, tmp_path):
    import datasets

    recs = [{"prompt": f"Tell me about {t.split('.')[0].lower()}.", "completion": " " + t}
            for t in generated_texts(80, seed=4)]
    datasets.Dataset.from_list(recs).to_parquet(str(tmp_path / "pc.parquet"))
    assert train(files, tmp_path / "parquet", data=tmp_path / "pc.parquet", steps=2) == 0
    assert train(files, tmp_path / "jsonl", data=write_jsonl(tmp_path / "pc.jsonl", recs), steps=2) == 0
    assert_all_equal("Parquet vs JSON Lines", run_state(tmp_path / "jsonl"), run_state(tmp_path / "parquet"))
    config = json.loads((tmp_path / "parquet/config.json").read_text())
    assert config["data"]["records"] == 80
