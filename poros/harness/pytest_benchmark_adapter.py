"""What the harness needs of pytest-benchmark beyond its public surface (the `benchmark` fixture's `pedantic`, its
`extra_info`, its hooks and options), in one place: resuming a cell across processes puts the passes an earlier
process timed into the fixture's statistics, the per-cell checkpoint of its JSON needs the session's benchmarks, and
`--benchmark-compare` is checked (and matched under today's cell ids) against the source it loaded.

Checked against pytest-benchmark 5.3.1 (`BenchmarkFixture._make_stats`, `Metadata.stats`, the session object
pytest-benchmark keeps as `config._benchmarksession` and its `benchmarks`, `compared_mapping`,
`performance_regressions`, `storage`); `CHECKED` names that version and tests/harness/test_benchmark_adapter.py fails
where an installed version lacks one of them.
"""

from __future__ import annotations

CHECKED = "5.3.1"


def session(config):
    """pytest-benchmark's session of this pytest run (None without the plugin)."""
    return getattr(config, "_benchmarksession", None)


def timed_benchmarks(config) -> list:
    """The benchmarks this session has timed so far, as pytest-benchmark writes them into its JSON."""
    bs = session(config)
    return [b for b in bs.benchmarks if b] if bs is not None else []


def add_earlier_rounds(benchmark, seconds) -> None:
    """Inside `benchmark.pedantic`, before its first timed round: the rounds an earlier process timed the same way
    come first in the fixture's statistics."""
    for t in seconds:
        benchmark.stats.stats.update(t)


def last_round(benchmark) -> float:
    """The seconds of the round `benchmark.pedantic` timed last (read in its teardown)."""
    return benchmark.stats.stats.data[-1]


def rounds_without_running(benchmark, seconds) -> bool:
    """Give `benchmark` (no round timed in this process) the rounds `seconds`, as `benchmark.pedantic(...,
    iterations=1)` would have made them; False where the fixture cannot take them."""
    if not hasattr(benchmark, "_make_stats"):
        return False
    stats = benchmark._make_stats(1)  # what `pedantic(..., iterations=1)` makes before its rounds
    for s in seconds:
        stats.update(s)
    return True


def compare_source(config) -> tuple[object, dict]:
    """(`--benchmark-compare`'s value, {source path: {benchmark fullname: benchmark}} pytest-benchmark loaded)."""
    bs = session(config)
    if bs is None:
        return None, {}
    return bs.compare, bs.compared_mapping or {}


def compare_storage(config) -> str:
    bs = session(config)
    return str(bs.storage) if bs is not None else ""


def also_compare_as(config, rename) -> None:
    """Make each compared benchmark findable under `rename(fullname)` too (cell ids of earlier runs)."""
    for names in compare_source(config)[1].values():
        names.update({rename(k): v for k, v in list(names.items())})


def regressions(config) -> list[tuple[str, str]]:
    """(benchmark, why) of each regression past `--benchmark-compare-fail` pytest-benchmark found."""
    bs = session(config)
    return list(bs.performance_regressions) if bs is not None else []
