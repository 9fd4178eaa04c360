"""The matrix suites' pytest-benchmark record (poros/suites/plugin.py): where its JSON goes, the earlier runs'
benchmarks a resumed run keeps, what its hooks add (the GPU to `machine_info`, the engine to `commit_info`, each
cell's passes), and the checks that refuse a `--benchmark-compare` that would compare nothing or rounds of another
pass length. What it needs beyond pytest-benchmark's public surface is in poros/harness/pytest_benchmark_adapter.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pytest_benchmark.utils import safe_dumps

from poros.common.atomic import write_atomic
from poros.errors import PorosError
from poros.harness import pytest_benchmark_adapter as adapter
from poros.harness.compare import current_name, load_compare_source, pass_length_problem
from poros.suites.session import matrix_of


def json_path(config) -> Path | None:
    """Where pytest-benchmark writes this session's JSON (`--benchmark-json`; None where nothing is written)."""
    return getattr(config, "_poros_json", None)


def earlier_benchmarks(config) -> list[dict]:
    """With --resume, the benchmarks the earlier runs wrote: pytest-benchmark rewrites its JSON with this
    session's alone, and they are appended back at the end."""
    path = json_path(config)
    if not config.getoption("--resume") or path is None or not path.is_file():
        return []
    try:
        return json.loads(path.read_text()).get("benchmarks", [])
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return []


def check_compare(config) -> None:
    """`--benchmark-compare` / `--benchmark-compare-fail`: refused at the start where they would compare
    nothing (pytest-benchmark only warns, and its regression check then passes by default) or compare rounds of
    another pass length; names recorded under the earlier cell ids are matched under today's."""
    if adapter.session(config) is None:
        return
    compare, compared = adapter.compare_source(config)
    compare_fail = config.getoption("benchmark_compare_fail", None)
    if compare_fail and not compare:
        raise PorosError("--benchmark-compare-fail needs --benchmark-compare PATH: the benchmark.json of the run "
                         "to compare with, e.g. --benchmark-compare=OUT/earlier/1/benchmark.json")
    if not compare:
        return
    if compare_fail and config.getoption("benchmark_disable", False):
        raise PorosError("--benchmark-compare-fail with --benchmark-disable: nothing is timed to compare; drop one")
    if not compared:
        if isinstance(compare, str) and Path(compare).exists():
            load_compare_source(compare)  # says what is wrong with the file
        raise PorosError(f"--benchmark-compare {compare if compare is not True else ''}: no earlier run found "
                         f"in {adapter.compare_storage(config)}; pass the benchmark.json of the run to compare with, "
                         f"e.g. --benchmark-compare=OUT/earlier/1/benchmark.json")
    steps = matrix_of(config)[1].steps
    for path, names in compared.items():
        problem = pass_length_problem(list(names.values()), steps)
        if problem:
            raise PorosError(f"--benchmark-compare {path}: {problem}")
    adapter.also_compare_as(config, current_name)


def check_compared_cells(config, items) -> None:
    """A comparison must share cells with this selection: one sharing none compares nothing and its
    regression check could not fail."""
    compared = adapter.compare_source(config)[1]
    if not compared:
        return
    timed = [item.nodeid for item in items if "benchmark" in getattr(item, "fixturenames", ())]
    known = {name: bench for names in compared.values() for name, bench in names.items()}
    sources = ", ".join(map(str, compared))
    if timed and not set(known) & set(timed):
        raise pytest.UsageError(f"--benchmark-compare {sources}: none of its cells is one of the {len(timed)} timed "
                                f"cells selected here (it has e.g. {sorted(known)[0]}, this run e.g. {timed[0]}); "
                                f"compare with a run of the same matrix")


# what a cell's benchmark carries beside its rounds, from its row (steps: a round is one pass of that many steps)
ROW_INFO = ("steps", "s_per_step_median", "s_per_step_std", "tokens_per_s", "peak_vram_gb", "peak_vram_nvml_gb",
            "parity", "bytes_h2d_per_step", "copy_gbps", "copy_hidden_share", "plan_name", "sweep")


def row_info(row: dict) -> dict:
    """A cell's benchmark extra info: its row's figures (ROW_INFO)."""
    return {k: row.get(k) for k in ROW_INFO}


def has_entry(config, benchmark) -> bool:
    """Whether the earlier runs' JSON (kept under --resume) holds `benchmark`'s cell, by its test name in
    today's cell ids."""
    return any(current_name(b.get("fullname") or "").rpartition("::")[2] == benchmark.name
               for b in getattr(config, "_poros_benchmarks", []))


def rounds_from_row(benchmark, row: dict) -> bool:
    """Give `benchmark` (pytest-benchmark's fixture, no round timed in this process) the rounds of a finished
    cell's row: its passes' seconds (`per_pass_s`, each timed as `timed_rounds` times a round), in
    pytest-benchmark's own statistics. A part whose process or machine was lost after a cell's last pass, before
    its benchmark was written, leaves the row and its passes; the next part writes the entry from them. False
    where nothing is recorded (no fixture, --benchmark-disable, an untimed row)."""
    seconds = row.get("per_pass_s") or []
    if benchmark is None or getattr(benchmark, "disabled", True) or not seconds:
        return False
    return adapter.rounds_without_running(benchmark, seconds)


def machine_info(config) -> dict:
    """pytest-benchmark's machine information, through its hooks (ours adds the GPU: `update_machine_info`)."""
    info = config.hook.pytest_benchmark_generate_machine_info(config=config)
    config.hook.pytest_benchmark_update_machine_info(config=config, machine_info=info)
    return info


def commit_info(config) -> dict:
    """pytest-benchmark's commit information, through its hooks (ours names the engine: `update_commit_info`)."""
    info = config.hook.pytest_benchmark_generate_commit_info(config=config)
    config.hook.pytest_benchmark_update_commit_info(config=config, commit_info=info)
    return info


def update_machine_info(machine_info: dict) -> None:
    """The GPUs this process measures on (name, UUID, driver, memory), and torch's CUDA build."""
    from poros.provenance import provenance

    p = provenance()
    machine_info["gpus"] = p["gpus"]
    machine_info["torch"] = p["torch"]
    machine_info["cuda"] = p["cuda"]
    machine_info["host"] = p["host"]


def update_commit_info(commit_info: dict) -> None:
    """The engine that ran (`poros.provenance.git_info`: its commit, whether its tree held changes, the hash of its
    source files), over what pytest-benchmark found of the folder pytest ran in."""
    from poros.provenance import git_info, provenance

    git = git_info()
    commit_info.update({"id": git.get("commit") or "unknown", "dirty": git.get("dirty"), "project": "poros",
                        "source_tree": git.get("source_tree"), "source": git.get("source", "git"),
                        "version": provenance()["versions"]["poros"]})


def update_json(config, output_json: dict) -> None:
    """The JSON as a run in parts keeps it: the earlier parts' benchmarks (kept under --resume) before this
    session's (a cell timed again keeps this session's), and each benchmark's passes as the pass log holds them
    (index, seconds, GPU, process), so every write of the file, each checkpoint and pytest-benchmark's own at the
    session's end, holds every timed cell."""
    earlier = getattr(config, "_poros_benchmarks", [])
    mine = {b.get("fullname") for b in output_json.get("benchmarks", [])}
    output_json["benchmarks"] = [b for b in earlier if b.get("fullname") not in mine] + output_json.get("benchmarks", [])
    state = getattr(config, "_poros_session", None)
    if state is None:
        return
    cells = {c.id: c for c in state.cells if c.method is not None}
    for b in output_json["benchmarks"]:
        cell = cells.get(b.get("param"))
        if cell is None or b.get("fullname") not in mine:
            continue
        passes = state.passlog.passes(cell.id, state.cell_fingerprint(cell), state.matrix.passes)
        b["extra_info"] = {**(b.get("extra_info") or {}),
                           "passes": [{k: p.get(k) for k in ("index", "seconds", "gpu", "process")} for p in passes]}


def checkpoint(config) -> None:
    """The JSON pytest-benchmark writes when the run ends, written as well after each timed cell, whole under a
    temporary name and renamed (its hooks merge the earlier parts' benchmarks): a run whose process or machine is
    lost mid-run keeps every finished cell's benchmark. Machine and commit information are read once per run.

    Raises:
        WriteError: the file could not be written (it stays as it was).
    """
    path = json_path(config)
    benchmarks = adapter.timed_benchmarks(config)
    if path is None or config.getoption("benchmark_disable", False) or not benchmarks:
        return
    hook = config.hook
    if not hasattr(config, "_poros_benchmark_info"):
        config._poros_benchmark_info = (machine_info(config), commit_info(config))
    machine, commit = config._poros_benchmark_info
    data = hook.pytest_benchmark_generate_json(config=config, benchmarks=benchmarks, include_data=True,
                                               machine_info=machine, commit_info=commit)
    hook.pytest_benchmark_update_json(config=config, benchmarks=benchmarks, output_json=data)
    write_atomic(path, safe_dumps(data, ensure_ascii=True, indent=4), "the benchmark record",  # as pytest-benchmark
                 "the file stays as it was")
