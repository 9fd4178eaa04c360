"""The matrix suites' pytest-benchmark record (poros/suites/plugin.py): where its JSON goes, the earlier runs'
benchmarks a resumed run keeps, and the checks that refuse a `--benchmark-compare` that would compare nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pytest_benchmark.utils import safe_dumps

from poros.common.atomic import write_atomic
from poros.errors import PorosError
from poros.harness.compare import current_name, load_compare_source
from poros.suites.session import matrix_of


def json_path(config) -> Path | None:
    """Where pytest-benchmark writes this session's JSON (`--benchmark-json`; None where nothing is written)."""
    target = getattr(config.option, "benchmark_json", None)
    return Path(target) if isinstance(target, (str, Path)) else None


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
    nothing (pytest-benchmark only warns, and its regression check then passes by default); names recorded
    under the earlier cell ids are matched under today's."""
    bs = getattr(config, "_benchmarksession", None)  # pytest-benchmark's session, which loaded the source
    if bs is None:
        return
    if bs.compare_fail and not bs.compare:
        raise PorosError("--benchmark-compare-fail needs --benchmark-compare PATH: the benchmark.json of the run "
                         "to compare with, e.g. --benchmark-compare=results/cpu/benchmark.json")
    if not bs.compare:
        return
    if bs.compare_fail and bs.disabled:
        raise PorosError("--benchmark-compare-fail with --benchmark-disable: nothing is timed to compare; drop one")
    if not bs.compared_mapping:
        if isinstance(bs.compare, str) and Path(bs.compare).exists():
            load_compare_source(bs.compare)  # says what is wrong with the file
        raise PorosError(f"--benchmark-compare {bs.compare if bs.compare is not True else ''}: no earlier run found "
                         f"in {bs.storage}; pass the benchmark.json of the run to compare with, e.g. "
                         f"--benchmark-compare=results/cpu/benchmark.json")
    for names in bs.compared_mapping.values():
        names.update({current_name(k): v for k, v in list(names.items())})


def check_compared_cells(config, items) -> None:
    """A comparison must share cells with this selection: one sharing none compares nothing and its
    regression check could not fail."""
    bs = getattr(config, "_benchmarksession", None)
    if bs is None or not bs.compared_mapping:
        return
    timed = [item.nodeid for item in items if "benchmark" in getattr(item, "fixturenames", ())]
    known = {name: bench for names in bs.compared_mapping.values() for name, bench in names.items()}
    sources = ", ".join(map(str, bs.compared_mapping))
    if timed and not set(known) & set(timed):
        raise pytest.UsageError(f"--benchmark-compare {sources}: none of its cells is one of the {len(timed)} timed "
                                f"cells selected here (it has e.g. {sorted(known)[0]}, this run e.g. {timed[0]}); "
                                f"compare with a run of the same matrix")
    steps = matrix_of(config)[1].steps  # a benchmark round is one pass: passes of other lengths do not compare
    other = sorted({(b.get("extra_info") or {}).get("steps") for name, b in known.items() if name in timed} - {steps, None})
    if other:
        raise pytest.UsageError(f"--benchmark-compare {sources}: its passes ran {other[0]} step(s) each, this run's "
                                f"{steps}; pass --steps {other[0]}, or compare with a run of {steps}-step passes")


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
    if benchmark is None or getattr(benchmark, "disabled", True) or not seconds or \
            not hasattr(benchmark, "_make_stats"):  # pytest-benchmark's own (private) maker of a benchmark's stats
        return False
    stats = benchmark._make_stats(1)  # what `benchmark.pedantic(..., iterations=1)` makes before its rounds
    for s in seconds:
        stats.update(s)
    return True


def _write_with_earlier(config, data: dict) -> None:
    """`data` (pytest-benchmark's JSON of this session) written to its path with the earlier runs' benchmarks
    before this session's (a cell timed again keeps this session's), in one replace."""
    path = json_path(config)
    earlier = getattr(config, "_poros_benchmarks", [])
    mine = {b.get("fullname") for b in data.get("benchmarks", [])}
    data["benchmarks"] = [b for b in earlier if b.get("fullname") not in mine] + data.get("benchmarks", [])
    write_atomic(path, safe_dumps(data, ensure_ascii=True, indent=4), "the benchmark record",  # as pytest-benchmark
                 "the file stays as it was")


def save_atomically(config) -> None:
    """pytest-benchmark writes its JSON at the session's end by opening the file for writing, which a full disk
    leaves cut short (and its error ends pytest in a traceback): its session writes it through `write_atomic`
    instead; a write that fails keeps the earlier file and stops the run as any failed record does."""
    bs, path = getattr(config, "_benchmarksession", None), json_path(config)
    if bs is None or path is None or not hasattr(bs, "save_json"):
        return

    def save_json(output_json):
        try:
            write_atomic(path, safe_dumps(output_json, ensure_ascii=True, indent=4), "the benchmark record",
                         "the file stays as it was")
        except PorosError as e:
            state = getattr(config, "_poros_session", None)
            if state is not None:
                state.write_failed = state.write_failed or str(e)

    bs.save_json = save_json


def checkpoint(config) -> None:
    """The JSON pytest-benchmark writes when the run ends, written as well after each timed cell (the earlier
    runs' benchmarks kept under --resume): a run whose process or machine is lost mid-run keeps every
    finished cell's benchmark. Machine and commit information are read once per run."""
    bs, path = getattr(config, "_benchmarksession", None), json_path(config)
    if bs is None or path is None or bs.disabled or not [b for b in bs.benchmarks if b]:
        return
    hook = config.hook
    if not hasattr(config, "_poros_benchmark_info"):
        commit_info = hook.pytest_benchmark_generate_commit_info(config=config)
        hook.pytest_benchmark_update_commit_info(config=config, commit_info=commit_info)
        config._poros_benchmark_info = (bs.get_machine_info(), commit_info)
    machine_info, commit_info = config._poros_benchmark_info
    data = hook.pytest_benchmark_generate_json(config=config, benchmarks=bs.benchmarks, include_data=True,
                                               machine_info=machine_info, commit_info=commit_info)
    hook.pytest_benchmark_update_json(config=config, benchmarks=bs.benchmarks, output_json=data)
    _write_with_earlier(config, data)


def append_earlier(config) -> None:
    """With --resume, the earlier runs' benchmarks appended back to the JSON pytest-benchmark has just written
    with this session's alone (a cell timed again keeps this session's)."""
    earlier, path = getattr(config, "_poros_benchmarks", []), json_path(config)
    if earlier and path is not None and path.is_file():  # pytest-benchmark has written this session's
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if isinstance(data, dict):
            try:
                _write_with_earlier(config, data)
            except PorosError as e:  # the session's own JSON stays as pytest-benchmark wrote it
                state = getattr(config, "_poros_session", None)
                if state is not None:
                    state.write_failed = state.write_failed or str(e)
