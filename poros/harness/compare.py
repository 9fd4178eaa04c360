"""Comparing a run's timings with an earlier run's (pytest-benchmark's `--benchmark-compare` and
`--benchmark-compare-fail`): the checks made before a run starts, and the cell names runs recorded
before today's cell ids used."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from pytest_benchmark.utils import parse_compare_fail as parse_check

from poros.errors import ConfigError, PorosError

# Cell ids once read `model=M-stack=S-method=X`; `=` is not a -k word, so they became `model:M-...`.
_EARLIER_ID = re.compile(r"(?<![\w.])(model|stack|method|plan|gate)=")


def current_name(fullname: str) -> str:
    """A benchmark's name in today's cell ids: committed runs recorded before the ids changed wrote
    `suites/test_matrix.py::test_step[model=tiny-qwen2-stack=current-method=poros]`."""
    head, bracket, params = fullname.partition("[")
    return head + bracket + _EARLIER_ID.sub(r"\1:", params) if bracket else fullname


def load_compare_source(path) -> list[dict]:
    """The benchmarks of a run to compare with: a `benchmark.json` as `poros bench` (or pytest's
    `--benchmark-json` or `--benchmark-save`) wrote it.

    Raises:
        PorosError: naming the file and what pytest-benchmark could not load from it.
    """
    where = f"--benchmark-compare {path}"
    p = Path(path)
    if p.is_dir():
        raise PorosError(f"{where} is a folder, expected a benchmark.json file, e.g. {p / 'benchmark.json'}")
    if not p.is_file():
        raise PorosError(f"{where}: no such file; pass a benchmark.json an earlier run wrote, e.g. "
                         f"results/cpu/benchmark.json")
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PorosError(f"{where}: not a benchmark JSON file ({e}); pass the benchmark.json a run wrote") from None
    benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
    if not isinstance(benchmarks, list) or not benchmarks:
        raise PorosError(f"{where}: holds no benchmarks (no \"benchmarks\" list); pass the benchmark.json of a "
                         f"run that timed cells")
    bad = [i for i, b in enumerate(benchmarks) if not (isinstance(b, dict) and isinstance(b.get("fullname"), str)
                                                       and isinstance(b.get("stats"), dict)
                                                       and isinstance(b["stats"].get("mean"), (int, float)))]
    if bad:
        raise PorosError(f"{where}: benchmark {bad[0]} has no fullname or no timing stats; pass a benchmark.json "
                         f"pytest-benchmark wrote")
    return benchmarks


def pass_length_problem(benchmarks: list[dict], steps: int) -> str | None:
    """Why `benchmarks` (a benchmark.json's) cannot be compared with a run of `steps`-step passes (None where they
    can): a benchmark round is one pass, so rounds of another pass length, or of a length the file does not record
    (`extra_info.steps`, absent from runs of an earlier harness), compare other work."""
    lengths = [(b.get("extra_info") or {}).get("steps") for b in benchmarks]
    unknown = [b.get("name") or b.get("fullname") for b, n in zip(benchmarks, lengths) if not isinstance(n, int)]
    if unknown:
        return (f"its benchmark {unknown[0]} records no pass length (extra_info.steps; a run of an earlier harness), "
                f"so its rounds cannot be held to this run's {steps}-step passes; compare with a run that records it")
    other = sorted({n for n in lengths if n != steps})
    if other:
        return (f"its passes ran {other[0]} step(s) each, this run's {steps}; pass --steps {other[0]}, or compare "
                f"with a run of {steps}-step passes")
    return None


def parse_compare_fail(exprs) -> list:
    """pytest-benchmark's regression checks, e.g. `mean:10%` (slower by more than 10 %) or `min:0.5`
    (slower by more than 0.5 s).

    Raises:
        ConfigError: listing every expression it cannot read.
    """
    checks, problems = [], []
    for expr in exprs or ():
        try:
            checks.append(parse_check(expr))
        except argparse.ArgumentTypeError:
            problems.append(f"{expr!r}: expected FIELD:N% (a whole percentage) or FIELD:SECONDS, FIELD one of min, "
                            f"max, mean, median, stddev, iqr; e.g. mean:10%")
    if problems:
        raise ConfigError(problems, "--benchmark-compare-fail")
    return checks

