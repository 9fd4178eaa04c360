"""Up-front checks (`poros.harness.preflight`) and the host-memory check of a build: each refusal is one
line naming the setting, and each check also lets the valid case through."""

from __future__ import annotations

import pytest
import torch

import poros.store.build
import poros.store.host_memory
from poros.harness import preflight
from poros.store.build import build_store
from poros.store.host_memory import config_host_need, store_bytes
from poros.errors import CapabilityError, ConfigError, PorosError
from poros.config import Method
from poros.harness.cells import matrix_cells
from poros.harness.matrix import parse_matrix
from poros.models.shapes import get_shape
from tests.capabilities import requires_bitsandbytes
from tests.suite_runs import SWEPT

TINY = dict(name="t", steps=1, passes=1, warmup_passes=0, seq_len=64, batch_size=1, grad_accum=1, lora_rank=4,
            lora_alpha=8, block_size=2, dataset="synthetic", stacks=["current"], methods=["poros", "resident"],
            models=["tiny-qwen2"])


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, f"not a one-line message: {msg!r}"
    return msg


@pytest.mark.parametrize("name,value", [("steps", 0), ("passes", 0), ("parity_steps", 0), ("parity_steps", -1)],
                         ids=["steps=0", "passes=0", "parity-steps=0", "parity-steps=-1"])
def test_counts_below_one_are_refused_not_replaced(name, value):
    with pytest.raises(ConfigError) as e:
        preflight.check_counts("poros bench", **{name: value})
    msg = _one_line(e.value)
    assert f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}" in msg, msg
    preflight.check_counts("poros bench", **{name: 1})  # control: 1 is fine
    preflight.check_counts("poros bench", **{name: None})  # and absent means the matrix's own


def test_every_bad_count_is_listed_at_once():
    with pytest.raises(ConfigError) as e:
        preflight.check_counts("poros bench", steps=0, passes=-2, parity_steps=0)
    assert len(e.value.problems) == 3


def _no_cuda(monkeypatch, build: str | None):
    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def test_cuda_without_cuda_is_refused_naming_why(monkeypatch):
    _no_cuda(monkeypatch, None)
    with pytest.raises(CapabilityError) as e:
        preflight.check_device("cuda", "--device")
    msg = _one_line(e.value)
    assert msg.startswith("--device: cuda requested") and "CPU-only build" in msg and "device cpu" in msg, msg
    _no_cuda(monkeypatch, "12.8")  # a CUDA build on a machine without a GPU
    with pytest.raises(CapabilityError) as e:
        preflight.check_device("cuda", "m.yaml: device")
    assert "finds no CUDA GPU" in _one_line(e.value)
    preflight.check_device("cpu", "--device")  # control


def test_cuda_with_a_gpu_passes_and_a_missing_index_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    preflight.check_device("cuda", "--device")
    preflight.check_device("cuda:0", "--device")
    with pytest.raises(CapabilityError) as e:
        preflight.check_device("cuda:1", "--device")
    assert "sees 1 CUDA GPU" in _one_line(e.value)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cpu:0", ""], ids=lambda d: f"device={d or 'empty'}")
def test_a_device_that_is_no_device_name_is_refused(device):
    with pytest.raises(ConfigError) as e:
        preflight.check_device(device, "--device")
    assert "expected cpu, cuda or cuda:N" in _one_line(e.value)


def test_seq_len_beyond_a_models_positions_is_named_per_model(tmp_path):
    limit = get_shape("tiny-qwen2").config().max_position_embeddings
    m = parse_matrix({**TINY, "seq_len": limit + 1, "models": ["tiny-qwen2", "tiny-gemma3"]}, "m.yaml")
    with pytest.raises(ConfigError) as e:
        preflight.check_matrix(m)
    assert len(e.value.problems) == 2
    assert f"seq_len: {limit + 1} exceeds tiny-qwen2's max_position_embeddings ({limit})" in e.value.problems[0]
    preflight.check_matrix(parse_matrix({**TINY, "seq_len": limit}, "m.yaml"))  # the limit itself is fine


def test_a_checkpoint_folders_limit_is_read_from_its_config(tmp_path):
    config = get_shape("tiny-qwen3").config()
    config.max_position_embeddings = 96
    config.save_pretrained(tmp_path)  # config.json alone: nothing is read but the config
    assert preflight.model_problems([str(tmp_path)], 96) == []
    problems = preflight.model_problems([str(tmp_path)], 128)
    assert problems == [f"seq_len: 128 exceeds {tmp_path}'s max_position_embeddings (96); use seq_len <= 96"]


def test_a_matrix_file_that_is_binary_or_a_folder_is_one_line(tmp_path):
    binary = tmp_path / "m.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00")
    for target, expected in ((binary, "not UTF-8"), (tmp_path, "is a folder")):
        with pytest.raises(ConfigError) as e:
            preflight.load_matrix(str(target))
        assert expected in _one_line(e.value) and str(target) in str(e.value)


def test_a_bad_k_expression_is_refused_before_the_run():
    with pytest.raises(ConfigError) as e:
        preflight.check_keyword("qwen and (poros")
    assert "-k 'qwen and (poros'" in _one_line(e.value)
    preflight.check_keyword("qwen and not unsloth")


def test_resume_refuses_rows_of_another_matrix_or_other_steps(tmp_path):
    from poros.harness.cells import cell_config, matrix_cells
    from poros.harness.result_row import record

    m = parse_matrix(TINY, "m.yaml")
    cell = next(c for c in matrix_cells(m) if c.method is not None)
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False)
    preflight.check_resume([row], m, "r.jsonl")  # the same run
    with pytest.raises(PorosError) as e:
        preflight.check_resume([dict(row, matrix="h200")], m, "r.jsonl")
    assert "matrix 'h200'" in _one_line(e.value)
    with pytest.raises(PorosError) as e:
        preflight.check_resume([dict(row, steps=20, passes=3)], m, "r.jsonl")
    assert "--steps 20 --passes 3" in _one_line(e.value)


def test_resume_refuses_rows_and_passes_of_another_commit():
    """One engine per results folder: a row or a recorded pass of another commit is refused, naming both."""
    from poros.harness.cells import cell_config, matrix_cells
    from poros.harness.result_row import record
    from poros.provenance import current_commit

    m = parse_matrix(TINY, "m.yaml")
    cell = next(c for c in matrix_cells(m) if c.method is not None)
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False)
    here = current_commit()
    passed = {"kind": "pass", "cell": cell.id, "fingerprint": "f", "commit": here, "index": 0, "seconds": 1.0}
    preflight.check_resume([row], m, "r.jsonl", [passed])  # this commit's row and pass: kept
    other = dict(row, provenance={**row["provenance"], "git": {"commit": "0" * 40, "dirty": False}})
    with pytest.raises(PorosError) as e:
        preflight.check_resume([other], m, "r.jsonl", [passed])
    assert "r.jsonl:1 was measured at commit " + "0" * 40 in _one_line(e.value)
    with pytest.raises(PorosError) as e:
        preflight.check_resume([row], m, "r.jsonl", [dict(passed, commit="1" * 40)])
    assert "passes.jsonl:1 was measured at commit " + "1" * 40 in _one_line(e.value)
    with pytest.raises(PorosError) as e:  # a run that cannot tell its commit cannot continue one that could
        preflight.check_resume([row], m, "r.jsonl", [], commit=None)
    assert "set POROS_GIT_COMMIT" in _one_line(e.value)


def test_resume_needs_a_pytest_benchmark_that_keeps_the_earlier_benchmark_json():
    with pytest.raises(PorosError) as e:
        preflight.check_benchmark_json_resumable("5.1.0", resume=True)
    assert "pytest-benchmark 5.1.0 empties benchmark.json" in _one_line(e.value)
    preflight.check_benchmark_json_resumable("5.1.0", resume=False)  # a new run: nothing to keep
    preflight.check_benchmark_json_resumable("5.3.1", resume=True)
    preflight.check_benchmark_json_resumable("6.0", resume=True)


def test_a_report_never_writes_over_its_input(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("{}\n")
    other = tmp_path / "other.jsonl"
    for out, expected in ((results, "would write over the input"), (other, "ending in .md"),
                          (tmp_path / "r.md", None), (tmp_path, "folder")):
        if expected is None:
            preflight.check_report_paths([str(results)], str(out))  # control: a new .md file is fine
            continue
        with pytest.raises(PorosError) as e:
            preflight.check_report_paths([str(results)], str(out))
        assert expected in _one_line(e.value)
    named_md = tmp_path / "x.md"  # an input that happens to end in .md
    with pytest.raises(PorosError) as e:
        preflight.check_report_paths([str(named_md)], str(named_md))
    assert "would write over the input" in _one_line(e.value)
    with pytest.raises(PorosError) as e:
        preflight.check_report_paths([str(results)], str(results / "r.md"))
    assert "is a file" in _one_line(e.value)


# --- host memory ---------------------------------------------------------------------------------


@requires_bitsandbytes
@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-gemma4"])
def test_store_bytes_from_the_config_is_what_the_build_holds(stores, model):
    store = stores(model)
    held = store.arena.numel() + sum(t.numel() * t.element_size() for t in [*store.dense.values(),
                                                                                 *store.buffers.values()])
    assert store_bytes(get_shape(model).config()) == held


@pytest.mark.slow  # end to end in subprocesses or ranks: the slow tier
def test_a_build_that_would_not_fit_is_refused_before_allocating(monkeypatch):
    need = config_host_need(get_shape("qwen2.5-72b").config(), "cpu")
    assert 40e9 < need.total < 60e9, need  # the 39.5 GB store plus its bf16 embeddings and a layer
    wanted = int(need.total * (1 + poros.store.host_memory.MEMORY_HEADROOM))
    allocated = []

    class Allocated(Exception):
        """The (stubbed) arena allocation was reached: the build stops there, before quantizing a layer."""

    def allocate(n):
        allocated.append(n)
        raise Allocated

    monkeypatch.setattr(poros.store.build, "host_buffer", allocate)
    monkeypatch.setattr(poros.store.host_memory, "available_host_memory", lambda: wanted - 1)
    with pytest.raises(PorosError) as e:
        build_store("qwen2.5-72b", device="cpu", progress=False)
    msg = _one_line(e.value)
    assert "building qwen2.5-72b needs about" in msg and "GB is available" in msg, msg
    assert allocated == []
    monkeypatch.setattr(poros.store.host_memory, "available_host_memory", lambda: wanted)
    with pytest.raises(Allocated):  # control: enough memory passes the check and reaches the (stubbed) allocation
        build_store("qwen2.5-72b", device="cpu", progress=False)
    assert allocated == [need.arena]


def test_a_cuda_build_needs_no_host_room_for_the_layer_being_quantized():
    config = get_shape("qwen3-32b").config()
    cpu, cuda = config_host_need(config, "cpu"), config_host_need(config, "cuda")
    assert cuda.transient == 0 and cpu.transient > 0 and cpu.store == cuda.store


def test_resume_refuses_rows_of_another_gpu_model():
    """A run measured on H200s continues on H200s: rows of another GPU model are refused, naming both; the same
    model (another card of it: parts of one run often are) and a CPU matrix's rows are kept."""
    from poros.harness.cells import cell_config, matrix_cells
    from poros.harness.result_row import record

    m = parse_matrix(TINY, "m.yaml")
    cell = next(c for c in matrix_cells(m) if c.method is not None)
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False)
    h200 = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-aaaa", "memory_gb": 150.0}
    on_gpu = dict(row, config={**row["config"], "device": "cuda"}, provenance={**row["provenance"], "gpus": [h200]})
    other_card = {**h200, "uuid": "GPU-bbbb"}
    preflight.check_resume([on_gpu], m, "r.jsonl", gpu="NVIDIA H200")
    preflight.check_resume([dict(on_gpu, provenance={**on_gpu["provenance"], "gpus": [other_card]})], m, "r.jsonl",
                           gpu="NVIDIA H200")
    with pytest.raises(PorosError) as e:
        preflight.check_resume([on_gpu], m, "r.jsonl", gpu="NVIDIA H100 80GB HBM3")
    msg = _one_line(e.value)
    assert "ran on an NVIDIA H200, this GPU is an NVIDIA H100 80GB HBM3" in msg and "another -o" in msg
    cpu_row = dict(row, provenance={**row["provenance"], "gpus": [h200]})  # a CPU cell on a GPU machine
    preflight.check_resume([cpu_row], m, "r.jsonl", gpu="NVIDIA H100 80GB HBM3")


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    from poros.errors import CapabilityError
    from poros.harness.preflight import check_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CapabilityError, match="2 data-parallel ranks need 2 CUDA GPUs; this host has 1"):
        check_ranks(2, "cuda", "m.yaml: gpus")
    check_ranks(2, "cpu", "m.yaml: gpus")  # processes on the CPU
    check_ranks(1, "cuda", "m.yaml: gpus")


def test_more_cpu_ranks_than_the_cores_take_are_refused(monkeypatch):
    """On the CPU, ranks are processes: at most CPU_RANKS_PER_CORE a usable core, whatever the matrix or the sweep
    asks; the count at the limit runs (the negative control)."""
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    most = 2 * preflight.CPU_RANKS_PER_CORE
    preflight.check_ranks(most, "cpu", "m.yaml: gpus")
    with pytest.raises(CapabilityError) as e:
        preflight.check_ranks(64, "cpu", "m.yaml: gpus")
    assert _one_line(e.value) == (
        "m.yaml: gpus: 64 data-parallel ranks on the CPU are 64 processes; this host gives this process 2 CPU "
        f"core(s), and a CPU run takes at most {preflight.CPU_RANKS_PER_CORE} ranks a core: set gpus to {most} or less")
    cpu = {**TINY, "device": "cpu"}
    preflight.check_matrix_ranks(parse_matrix({**cpu, "sweep": {"gpus": [1, most]}}, "m.yaml"), "cpu")
    for changes, where in (({"gpus": most + 1}, "m.yaml: gpus: "), ({"sweep": {"gpus": [1, most + 1]}},
                                                                      "m.yaml: sweep.gpus: ")):
        m = parse_matrix({**cpu, **changes}, "m.yaml")
        assert m.most_ranks() == most + 1
        with pytest.raises(CapabilityError, match=f"^{where}{most + 1} data-parallel ranks on the CPU"):
            preflight.check_matrix_ranks(m, "cpu")


def test_resume_refuses_rows_of_other_computed_settings_plans_or_stacks(tmp_path):
    from poros.errors import PorosError
    from poros.harness.cells import cell_config
    from poros.harness.result_row import record
    from poros.harness.preflight import check_resume

    m = parse_matrix(SWEPT)
    cell = [c for c in matrix_cells(m) if c.plan == "b1"][1]  # at grad_accum 2
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False)
    check_resume([row], m, "r.jsonl")  # its own row: kept
    for change, named in ((dict(sweep={"grad_accum": [1, 4]}), "a cell this matrix does not have"),
                          (dict(sweep={"grad_accum": [1, 2]}, lora_rank=8), "lora_rank: the rows have 4, the matrix 8"),
                          (dict(plans={"streamed": {}, "b1": {"block_size": 2}}), "block_size: the rows have 1"),
                          (dict(plans={"streamed": {}}), "a cell this matrix does not have")):
        with pytest.raises(PorosError, match=named):
            check_resume([row], parse_matrix({**SWEPT, **change}), "r.jsonl")
    with pytest.raises(PorosError, match="ran on stack 'torch 0.0'"):
        check_resume([{**row, "stack": "torch 0.0"}], m, "r.jsonl")


def test_resume_keeps_rows_of_a_budget_of_auto_and_refuses_a_changed_budget():
    """A plan of `vram_budget: auto` resolves to what the device had free; its row keeps the setting asked (the
    resolved bytes are its plan's), so a later part of the same matrix continues from it, while a matrix whose budget
    changed is refused (the negative control)."""
    from poros.harness.cells import cell_config
    from poros.harness.result_row import record

    spec = {**TINY, "device": "cuda", "plans": {"auto": {"vram_budget": "auto"}}}
    m = parse_matrix(spec, "m.yaml")
    cell = next(c for c in matrix_cells(m) if c.method is Method.POROS)
    keys = ("block_size", "resident_layers", "streamed_layers", "kept_layers", "head_resident", "h2d_bytes_per_step",
            "peak_vram_bytes", "process_vram_bytes", "memory", "vram_budget", "accumulation", "graph_pool_bytes",
            "shards", "gathered_bytes_per_step", "d2h_bytes_per_step", "host_inputs", "host_input_bytes",
            "host_bytes", "host_budget")
    plan = {**dict.fromkeys(keys, 0), "vram_budget": 83_272_251_474, "resident_layers": [0, 1], "streamed_layers": []}
    row = record(m, cell, cell_config(m, cell), None, None, reduced=False, plan=plan)
    assert row["config"]["vram_budget"] == "auto" and row["plan"]["vram_budget"] == 83_272_251_474
    preflight.check_resume([row], m, "r.jsonl", gpu=None)
    with pytest.raises(PorosError, match="vram_budget: the rows have 'auto', the matrix 40000000000"):
        preflight.check_resume([row], parse_matrix({**spec, "plans": {"auto": {"vram_budget": "40GB"}}}, "m.yaml"),
                               "r.jsonl", gpu=None)
