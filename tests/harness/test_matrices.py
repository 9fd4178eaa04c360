"""Every matrix file loads and validates; the official matrices reproduce the configuration of the official
validation results (reports/reference/README.md);
a malformed file (bad model overrides among them) is refused with every problem listed at once; numbers in
exponent form (`1e-4`) are read as numbers."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from poros.config import Device, Method
from poros.errors import ConfigError
from poros.harness.matrix import MATRICES, load_matrix, parse_matrix
from poros.models.shapes import SHAPES
from poros.harness.report import load_reference
from tests.suite_runs import TINY

FILES = sorted(MATRICES.glob("*.yaml"))

# The Configuration table of "Poros — Official Validation Results (NVIDIA B300 SXM6)" (reports/reference/README.md).
OFFICIAL = dict(steps=200, passes=3, seq_len=512, batch_size=1, grad_accum=1, lora_rank=16, lora_alpha=32,
            block_size=4, dataset="synthetic", precision="nf4")


def test_matrices_folder_is_not_empty():
    assert FILES, f"no matrices/*.yaml under {MATRICES}"


@pytest.mark.parametrize("path", FILES, ids=[f"matrix={p.stem}" for p in FILES])
def test_matrix_file_loads(path):
    m = load_matrix(str(path))
    assert m.name == path.stem, f"{path.name}: name {m.name!r} does not match the file name"
    assert m.models and m.methods and m.stacks
    unknown = [x for x in m.models if x not in SHAPES]
    assert not unknown, f"{path.name}: models not in the registry: {unknown}"
    assert len(set(m.models)) == len(m.models), f"{path.name}: a model is listed twice"
    by_name = load_matrix(path.stem)
    assert dataclasses.replace(by_name, source=m.source) == m, "loading by name and by path differ"


@pytest.mark.parametrize("path", FILES, ids=[f"matrix={p.stem}" for p in FILES])
def test_every_shipped_matrix_passes_validate(path):
    """What `poros validate` and a run's start check beyond the file (models, reference, every poros plan against
    the planner): a shipped matrix that fails them cannot run at all."""
    from poros.harness.preflight import check_matrix

    check_matrix(load_matrix(str(path)))


def test_validate_refuses_a_plan_below_the_smallest(tmp_path):
    """Negative control of the check above: a 24 GB plan at 32,768 tokens without the chunked MLP is refused."""
    import yaml

    from poros.errors import ConfigError
    from poros.harness.preflight import check_matrix

    data = yaml.safe_load((MATRICES / "h200-long.yaml").read_text())
    data["sweep"] = {"seq_len": [32768]}
    path = tmp_path / "h200-long.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="below the smallest plan"):
        check_matrix(load_matrix(str(path)))


def _load_or_skip(name: str):
    path = MATRICES / f"{name}.yaml"
    if not path.is_file():
        pytest.skip(f"matrices/{name}.yaml does not exist")
    return load_matrix(str(path))


@pytest.mark.parametrize("name", ["b300", "a100", "h200"], ids=lambda n: f"matrix={n}")
def test_official_matrix_reproduces_official_configuration(name):
    m = _load_or_skip(name)
    got = {k: getattr(m, k) for k in OFFICIAL}
    assert got == OFFICIAL, f"{name}.yaml differs from the official configuration: " + ", ".join(
        f"{k}={got[k]!r} (official {v!r})" for k, v in OFFICIAL.items() if got[k] != v)
    assert set(m.methods) == {Method.POROS, Method.RESIDENT, Method.UNSLOTH}
    assert not any(SHAPES[x].tiny for x in m.models), f"{name}.yaml lists tiny models: {m.models}"
    assert m.device in (None, Device.CUDA)


def _reference_models(hardware: str) -> set[str]:
    """Registry names of the models the official reference figures list for `hardware`."""
    ref = load_reference()
    return {m.lower() for h, m in zip(ref["hardware"], ref["model"]) if hardware in h}


def test_b300_matrix_is_the_official_table():
    m = _load_or_skip("b300")
    assert "B300" in (m.hardware or "")
    assert set(m.models) == {"qwen3-32b", "qwen2.5-32b", "qwen2.5-72b"} == _reference_models("B300")
    # The official two stacks, each with torch's CUDA build, labelled as the reference labels them
    pinned = {(s.torch, s.transformers, s.bitsandbytes) for s in m.stacks if not s.is_current}
    assert pinned == {("2.10.0+cu128", "5.5.0", "0.49.2"), ("2.12.0+cu130", "5.10.1", "0.49.2")}
    assert {f"torch {t} / transformers {tf}" for t, tf, _ in pinned} == set(load_reference()["stack"].dropna())


def test_a100_matrix_covers_every_family():
    m = _load_or_skip("a100")
    assert "A100" in (m.hardware or "")
    assert set(m.models) == {"qwen2.5-32b", "qwen3-32b", "gemma3-27b", "gemma4-31b"} == _reference_models("A100")


def test_cpu_matrix_runs_tiny_models_on_cpu():
    m = _load_or_skip("cpu")
    assert m.device is Device.CPU
    assert set(m.models) == {n for n, s in SHAPES.items() if s.tiny}
    assert {Method.POROS, Method.RESIDENT} <= set(m.methods)


MALFORMED = {
    "name": "broken",
    "steps": "many",  # wrong type
    "passes": 3,
    # dataset: missing
    "batch_size": 1,
    "grad_accum": 1,
    "lora_rank": 16,
    "lora_alpha": 32,
    "block_size": 4,
    "methods": ["poros", "teleport"],  # unknown method
    "models": ["tiny-qwen2", "gpt-17"],  # unknown model
    "stacks": ["current", {"name": "old", "torch": "2.10.0"}],  # bad stack: missing keys
    "colour": "blue",  # unknown key
}
EXPECTED = {
    "unknown key": ("colour",),
    "missing key": ("dataset",),  # settings (seq_len, ...) take the settings table's defaults
    "wrong type": ("steps", "'many'"),
    "unknown model": ("models", "gpt-17"),
    "unknown method": ("methods", "teleport"),
    "bad stack": ("stacks[1]", "transformers"),
}


@pytest.fixture
def malformed(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(MALFORMED))
    return path


def test_malformed_matrix_lists_every_problem(malformed):
    with pytest.raises(ConfigError) as e:
        load_matrix(str(malformed))
    problems = e.value.problems
    assert str(malformed) in e.value.source
    unreported = [what for what, words in EXPECTED.items()
                  if not any(all(w in p for w in words) for p in problems)]
    assert not unreported, f"not reported: {unreported}; problems were {problems}"
    assert len(problems) == len(EXPECTED), f"expected {len(EXPECTED)} problems, got {problems}"


SINGLE = [("stacks", []), ("block_size", 0), ("attention", "warp"), ("dataset", "wiki"), ("mlp_chunk", 0),
          ("attention_chunk", 0)]


@pytest.mark.parametrize("key,bad", SINGLE, ids=[f"{k}={v!r}" for k, v in SINGLE])
def test_single_bad_field_is_named(tmp_path, key, bad):
    data = yaml.safe_load((MATRICES / "cpu.yaml").read_text())
    data[key] = bad
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_matrix(str(path))
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(key), e.value.problems


def test_validate_cli_exit_codes(capsys, malformed):
    from poros.cli import main

    assert main(["validate", str(malformed)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "colour" in out and "teleport" in out
    assert main(["validate", str(MATRICES / "cpu.yaml")]) == 0
    assert capsys.readouterr().out.startswith("ok")


def test_no_matrix_key_means_both_a_harness_field_and_a_setting():
    """A top-level key the harness reads for itself (passes, warm-up, ...) and a training setting of the same
    name would set both at once: `warmup_steps` once meant the bench's warm-up pass and the learning rate's
    warm-up in one."""
    from poros.harness import matrix

    def clashes(optional):
        return sorted(set(optional + matrix._REQUIRED) & set(matrix._MATRIX_SETTINGS))

    assert clashes(matrix._OPTIONAL) == []
    assert clashes(matrix._OPTIONAL + ("warmup_steps",)) == ["warmup_steps"]  # the check can fail


def test_the_warm_up_pass_and_the_learning_rate_warm_up_are_set_apart():
    from poros.harness.matrix import load_matrix

    m = load_matrix("h200")
    assert m.warmup_pass_steps == 20 and m.settings["warmup_steps"] == 20


def test_a_key_given_twice_is_named_with_both_lines(tmp_path):
    """PyYAML keeps the last of a repeated key without a word: the matrix would run the later value."""
    path = tmp_path / "twice.yaml"
    path.write_text((MATRICES / "cpu.yaml").read_text() + "seq_len: 64\n")
    with pytest.raises(ConfigError) as e:
        load_matrix(str(path))
    assert "key 'seq_len' is given on line" in str(e.value) and "give it once" in str(e.value), str(e.value)


def test_bad_model_overrides_are_refused_with_every_problem():
    import pytest

    from poros.errors import ConfigError

    bad = {**TINY, "methods": ["poros"], "models": ["tiny-qwen2"], "model_overrides": {
        "tiny-qwen3": {"cuda_graphs": False},  # not in the matrix
        "tiny-qwen2": {"seq_len": 128, "cuda_graphs": "yes", "vram_budget": "lots"}}}
    with pytest.raises(ConfigError) as e:
        parse_matrix(bad)
    text = str(e.value)
    for needle in ("model_overrides.tiny-qwen3: not one of this matrix's models",
                   "model_overrides.tiny-qwen2.seq_len: not overridable", "cuda_graphs: expected true or false",
                   "vram_budget: expected a size such as 24GB"):
        assert needle in text, text


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    from poros.harness.matrix import load_matrix

    path = tmp_path / "m.yaml"
    import yaml

    path.write_text(yaml.safe_dump({**TINY, "methods": ["poros"], "models": ["tiny-qwen2"]}) + "lr: 1e-4\n")
    assert yaml.safe_load(path.read_text())["lr"] == "1e-4"  # PyYAML's own reading: a string
    assert load_matrix(str(path)).lr == 1e-4


@pytest.mark.parametrize("name", ["cpu-torch210", "cpu-torch212"])
def test_the_cpu_matrix_on_a_stack_measures_what_cpu_does(name):
    """The stack check's CPU matrix (tox -e ENV) differs from cpu.yaml only in its name and the stack it pins, so the
    stacks page compares like with like."""
    cpu, other = load_matrix("cpu"), load_matrix(name)
    (stack,) = other.stacks
    assert name == f"cpu-{stack.name}" and not stack.is_current
    same = dict(name=cpu.name, stacks=cpu.stacks, source=cpu.source)
    assert dataclasses.replace(other, **same) == cpu
