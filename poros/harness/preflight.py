"""Checks made before any work starts: every refusal is one line naming the setting, what was
expected, what came in and what to do. Used by the CLI and by the matrix suites' session start."""

from __future__ import annotations

import json
import os
from pathlib import Path

from poros.choices import ATTENTION_NEEDS, Attention, Device
from poros.config import LORA_TARGETS, Method
from poros.engine.methods.registry import config_for
from poros.errors import CapabilityError, ConfigError, PorosError
from poros.harness.matrix import load_matrix as load
from poros.harness.matrix import resolve_matrix_path
from poros.harness.protocol import reference_problems
from poros.harness.results import passes_path
from poros.harness.report import load_reference
from poros.checkers import module_names
from poros.models.targets import layer_linear_names, resolve_targets
from poros.models.checkpoint import resolve
from poros.resolve import attention_device_problem
from poros.settings import COMPUTED_NAMES, SCHEDULE_NAMES
from poros.models.skeleton import (
    check_lora_rank,
    check_seq_len,
    check_supported,
    decoder_layers,
    skeleton,
)
from poros.store.host_memory import check_host_memory as check
from poros.store.host_memory import config_host_need
from poros.sizes import is_auto


def check_counts(source: str, **counts: int | None) -> None:
    """Step and pass counts given on a command line (None: the matrix's own) must be integers >= 1.

    Raises:
        ConfigError: listing every bad count, e.g. `--steps: expected an integer >= 1, got 0`.
    """
    problems = [f"--{name.replace('_', '-')}: expected an integer >= 1, got {value!r}"
                for name, value in counts.items()
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1)]
    if problems:
        raise ConfigError(problems, source)


def check_device(device: str, where: str) -> None:
    """`device` must be cpu, cuda or cuda:N, and a CUDA device must be present when asked for.

    Raises:
        ConfigError: not a device name.
        CapabilityError: CUDA asked for on a machine (or torch build) without it.
    """
    import torch

    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError([f"expected cpu, cuda or cuda:N, got {device!r}"], where)
    if kind != "cuda":
        return
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    elif not torch.cuda.is_available():
        why = "torch finds no CUDA GPU (driver missing or CUDA_VISIBLE_DEVICES empty)"
    elif index and int(index) >= torch.cuda.device_count():
        why = f"torch sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
    else:
        return
    raise CapabilityError(f"{where}: {device} requested, but {why}; use device cpu here, or run on a GPU machine "
                          f"with a CUDA build of torch")


def attention_problem(attention, device: str) -> str | None:
    """Why attention setting `attention` cannot run on `device` on this machine (None: it can), by its KernelNeeds
    (poros/choices.py): the device, then on this machine's GPU its compute capability, then the package's module,
    imported (the first call would import it: an install missing a dependency fails here, not mid-run). Values
    without needs (the SDPA lists) run wherever the device does."""
    attention = Attention(getattr(attention, "value", attention))
    needs = ATTENTION_NEEDS.get(attention)
    if needs is None:
        return None
    kind, _, index = str(getattr(device, "value", device)).partition(":")
    if kind != needs.device.value:
        return attention_device_problem(attention, Device(kind))
    instead = f"use attention {needs.instead.value} (--attention {needs.instead.value})"
    import torch

    if not torch.cuda.is_available():
        return f"attention: {attention.value} needs a CUDA GPU and torch finds none here; {instead}"
    gpu = int(index) if index else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(gpu)
    if major not in needs.majors:
        return (f"attention: {attention.value} needs a GPU of {needs.least}; {torch.cuda.get_device_name(gpu)} is "
                f"{major}.{minor}: {instead}")
    import importlib

    try:
        importlib.import_module(needs.module)
    except Exception as e:  # missing, or a dependency missing or broken: what the first call would meet
        why = (str(e).strip().splitlines() or [""])[0][:200]
        return (f"attention: {attention.value} needs {needs.package} (import {needs.module} failed: "
                f"{type(e).__name__}: {why}); install it (an offline GPU machine: scripts/stage_fa4.sh beside the "
                f"checkout, scripts/device_fa4.sh there) or {instead}")
    return None


def check_attention(attention, device: str, where: str) -> None:
    """`attention_problem` as an error, before any work.

    Raises:
        CapabilityError: `where`, then what the setting needs, what this machine has and the value to use instead.
    """
    problem = attention_problem(attention, device)
    if problem:
        raise CapabilityError(f"{where}: {problem}")


def matrix_attention(m, device: str) -> set:
    """The attention settings the cells of matrix `m` run with on `device` (top level, sweep, per method)."""
    from poros.harness.cells import matrix_cells

    found = {m.settings_for(c.model, dict(c.point), c.method, c.plan, device).get("attention", m.attention)
             for c in matrix_cells(m) if c.method is not Method.UNSLOTH}
    return {Attention(getattr(a, "value", a)) for a in found}


def matrix_attention_problems(m) -> list[str]:
    """Attention settings of matrix `m` its device (`device`, else this host's) cannot run (their KernelNeeds'
    device), one line each: what `poros validate` and `poros bench` refuse before any work. What a CUDA machine
    must have besides is checked where the run starts (`check_matrix_attention`): a file may be meant for another
    machine."""
    from poros.harness.cells import matrix_device

    device = Device(matrix_device(m))
    return [attention_device_problem(a, device) for a in sorted(matrix_attention(m, device.value), key=str)
            if a in ATTENTION_NEEDS and ATTENTION_NEEDS[a].device is not device]


def check_matrix_attention(m, device: str) -> None:
    """Every attention setting of matrix `m` must run on this machine's `device` (`attention_problem`).

    Raises:
        CapabilityError: naming the matrix and the first setting that cannot.
    """
    for attention in sorted(matrix_attention(m, device), key=str):
        check_attention(attention, device, m.source)


def model_problems(models, seq_len: int, lora_rank: int | None = None, lora_targets=None) -> list[str]:
    """Problems knowable from each model's config alone: an unreadable checkpoint folder, layers
    Poros cannot quantize, `seq_len` beyond the model's max_position_embeddings, and `lora_rank` beyond the
    smallest dimension of a linear it adapts (`lora_targets`, default every target)."""

    problems = []
    for model in models:
        try:
            src = resolve(model)
            try:
                check_seq_len(src.config, seq_len, model)
            except ConfigError as e:
                problems.extend(e.problems)
            try:  # a flag's `q_proj,v_proj` as the setting reads it; a value that is no list the settings refuse
                targets = module_names(lora_targets) if lora_targets is not None else None
            except ValueError:
                targets = None
            if targets is not None:
                try:
                    resolve_targets(layer_linear_names(src.config), targets, model)
                except ConfigError as e:
                    problems.append(str(e))
            if lora_rank is not None:
                try:
                    check_lora_rank(src.config, lora_rank, targets or LORA_TARGETS, model)
                except ConfigError as e:
                    problems.extend(e.problems)
            if src.checkpoint is not None:  # registered shapes are known to be supported
                list_name, layers = decoder_layers(skeleton(src.config))
                check_supported(src.name, layers, list_name)
                names = {n.rsplit(".", 1)[-1] for n, _ in layers[0].named_modules()} if len(layers) else set()
                if not names & set(LORA_TARGETS):
                    problems.append(f"{model}: its decoder layers have none of the LoRA target modules "
                                    f"({', '.join(LORA_TARGETS)}); Poros cannot attach adapters to it")
        except PorosError as e:
            problems.append(str(e))
    return problems


def check_matrix(m) -> None:
    """A loaded matrix, against its models' configs, where it names a reference the reference's attention paths,
    and on the CPU its rank count against this host's cores (`cpu_rank_problems`): what `poros validate` adds to the
    file checks, and what `poros bench` checks first.

    Raises:
        ConfigError: listing every problem.
    """
    seq_len = max(p.get("seq_len", m.seq_len) for p in m.points())  # the longest the sweep asks for
    rank = max(m.settings_for(m.models[0], p, method).get("lora_rank", m.lora_rank) for p in m.points()
               for method in m.methods)  # the largest any cell asks for
    problems = model_problems(m.models, seq_len, rank, m.lora_targets) + reference_problems(m)
    problems += cpu_rank_problems(m) + matrix_attention_problems(m)
    problems += plan_problems(m) if not problems else []
    if problems:
        raise ConfigError(problems, m.source)


def plan_problems(m) -> list[str]:
    """What `poros plan` refuses for a poros cell from its config alone, for every model, sweep point and plan
    of the matrix: a budget below the smallest plan (a `vram_budget: auto` is the run's device's to measure).
    The least plan the planner's search would build (`smallest_request`) is built first; only where it does not
    fit does the planner search, and refuse in its own words."""
    from poros.engine.planning.budget import make_plan, smallest_request
    from poros.engine.planning.geometry import Geometry
    from poros.engine.planning.inputs import host_refusal
    from poros.engine.planning.search import PlanRequest, build_plan
    from poros.harness.cells import Cell, cell_config
    from poros.harness.results import point_id

    if Method.POROS not in m.methods:
        return []
    problems, geometries = [], {}
    for model in m.models:
        for point in m.points():
            for plan in m.plan_names():
                cell = Cell(model, m.stacks[0], Method.POROS, tuple(point.items()), plan)
                try:
                    cfg = cell_config(m, cell)
                    if cfg.vram_budget is None or (is_auto(cfg.vram_budget) and cfg.device.value == "cuda"):
                        continue  # (auto: what the run's GPU has free; on the CPU the planner refuses it below)
                    key = (model, cfg.lora_targets, cfg.double_quant)
                    if key not in geometries:
                        geometries[key] = Geometry.of_config(model, resolve(model).config, *key[1:])
                    if is_auto(cfg.vram_budget):
                        make_plan(geometries[key], cfg)
                    request = PlanRequest.of_config(cfg)
                    least = build_plan(geometries[key], smallest_request(geometries[key], request))
                    if least.memory.total > request.budget or host_refusal(least, "") is not None:
                        make_plan(geometries[key], cfg)  # the planner's own search, and its refusal
                except PorosError as e:
                    where = " ".join(x for x in (point_id(point), plan and f"plan {plan}") if x)
                    problems.append(f"{model}{f' ({where})' if where else ''}: {e}")
    return problems


def check_host_memory(models, device: str) -> None:
    """Every model's build must fit in host memory (from its shapes alone, nothing allocated).

    Raises:
        PorosError: naming the first model that would not fit.
    """

    for model in models:
        src = resolve(model)
        check(src.name, config_host_need(src.config, device))


def load_matrix(name_or_path: str):
    """`poros.harness.matrix.load_matrix`, with a file that is not text (or not readable) refused in one line.

    Raises:
        ConfigError: naming the file.
    """

    if Path(name_or_path).is_dir():
        raise ConfigError(["is a folder, expected a matrix file (YAML), e.g. matrices/cpu.yaml"], name_or_path)
    path = resolve_matrix_path(name_or_path)
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"not a matrix file: byte {e.start} is not UTF-8 text (expected YAML)"], str(path)) from None
    except OSError as e:
        raise ConfigError([f"cannot read it ({e.strerror})"], str(path)) from None
    return load(name_or_path)


def _keyword_expression(expr: str):
    """`expr` compiled as pytest compiles a `-k` expression (None where pytest moved its parser: the run complains).

    Raises:
        ConfigError: naming the expression and pytest's complaint.
    """
    try:
        from _pytest.mark.expression import Expression
    except ImportError:
        return None
    try:
        return Expression.compile(expr.lstrip())  # pytest strips leading space as it reads -k
    except Exception as e:  # SyntaxError in pytest 8.4+, ParseError before
        why = getattr(e, "msg", None) or getattr(e, "message", None) or str(e)
        raise ConfigError([f"-k {expr!r}: not a valid selection ({why}); e.g. -k 'qwen3 and poros'"],
                          "poros bench") from None


def check_keyword(expr: str | None) -> None:
    """A `-k` expression must parse (pytest would report it only inside the run's log).

    Raises:
        ConfigError: naming the expression and pytest's complaint.
    """
    if expr:
        _keyword_expression(expr)


def selected_cells(m, expr: str | None) -> list:
    """The cells of `m` a `-k` expression selects, as pytest selects their items (`_pytest.mark.KeywordMatcher`: a
    word matches when it is part of one of the item's names, whatever its case; `cells.keyword_names`), known
    before any run starts; all of them without `expr`.

    Raises:
        ConfigError: an expression that does not parse, or that calls a word (`-k 'poros(x=1)'`).
    """
    from poros.harness.cells import keyword_names, matrix_cells

    cells = matrix_cells(m)
    expression = _keyword_expression(expr) if expr else None
    if expression is None:
        return cells

    def matcher(names: tuple[str, ...]):
        lowered = [n.lower() for n in names]

        def matches(word: str, **call) -> bool:
            if call:
                raise ConfigError([f"-k {expr!r}: a selection's words take no arguments, got {word}(...)"],
                                  "poros bench")
            return any(word.lower() in n for n in lowered)
        return matches

    return [c for c in cells if expression.evaluate(matcher(keyword_names(c)))]


def no_cell_selected(m, expr: str | None) -> str | None:
    """Why a `-k` expression selects no cell of `m` (None where it selects one, or where none is given): said before
    a run's output folder is touched, so that nothing there moves."""
    if not expr or selected_cells(m, expr):
        return None
    example = next(iter(selected_cells(m, None)), None)
    return f"no cell matched -k {expr!r}" + (f" (cell ids read like {example.id})" if example else "")


def check_report_paths(inputs, output, reference=None) -> None:
    """A report goes to a .md file that is none of its inputs (nor their PNG), in a writable folder.

    Raises:
        PorosError: naming the output and why it cannot be written.
    """
    from poros.paths import check_input, resolved

    out = Path(output)
    if out.is_dir():
        raise PorosError(f"-o {output} is a folder, expected a .md file name, e.g. -o {out / 'report.md'}")
    written = {resolved(out, "-o"), resolved(out.with_suffix(".png"), "-o")}
    for given in [*inputs, *([reference] if reference else [])]:
        check_input(given, "results file" if given != reference else "--reference")
        if resolved(given, "results file") in written:
            raise PorosError(f"-o {output} would write over the input {given}; a command never writes over its own "
                             f"input: pass another file, e.g. -o {out.with_name('report.md')}")
    if out.suffix.lower() != ".md":
        raise PorosError(f"-o {output}: expected a Markdown file name ending in .md (the report; its PNG is "
                         f"written beside it), e.g. -o {out.with_suffix('.md')}")
    folder = out.parent
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise PorosError(f"-o {output}: {probe} is a file, so the report's folder {folder} cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise PorosError(f"-o {output}: folder {probe} is not writable; pass a writable path")
    for target in (out, out.with_suffix(".png")):
        if target.exists() and not os.access(target, os.W_OK):
            raise PorosError(f"-o {output}: {target} exists and is read-only; pass another file")


def check_same_commit(records: list[dict], path, commit: str | None) -> None:
    """`--resume` continues one engine: rows (their provenance) and pass records (their `commit`) measured at
    another commit than `commit` (this run's) would mix two engines on one page.

    Raises:
        PorosError: naming the file, the line and both commits, and what to do.
    """
    for n, r in enumerate(records, 1):
        git = (r.get("provenance") or {}).get("git") if "provenance" in r else None
        recorded = git.get("commit") if isinstance(git, dict) else r.get("commit")
        if recorded != commit:
            where = "this run cannot tell its own commit (no git checkout: set POROS_GIT_COMMIT)" if commit is None \
                else f"this run is at {commit}"
            raise PorosError(f"--resume: {path}:{n} was measured at commit {recorded or 'unknown'}, {where}; run "
                             f"the rest from that commit (git worktree add DIR {recorded or 'COMMIT'}), or pass another -o")


RESUMABLE_BENCHMARK = (5, 3)  # pytest-benchmark from which --benchmark-json is a path, not a file opened at start


def check_benchmark_json_resumable(version: str | None, resume: bool) -> None:
    """A resumed run appends its timed cells to the earlier parts' benchmark.json; pytest-benchmark before 5.3
    opens that file for writing as it parses its options, erasing them before any plugin can read them.

    Raises:
        PorosError: naming the installed version and the one needed.
    """
    if not resume or version is None:
        return
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if parts < RESUMABLE_BENCHMARK:
        raise PorosError(f"--resume: pytest-benchmark {version} empties benchmark.json when it starts, losing the cells "
                         f"the earlier run timed; install pytest-benchmark>=5.3 (pip install -U pytest-benchmark)")


_THIS_PROCESS = object()  # check_resume's default: the commit this process runs, the GPU it sees


def this_gpu(m) -> str | None:
    """The name of the GPU a run of matrix `m` measures on (CUDA's first device), None for a CPU matrix."""
    from poros.harness.cells import matrix_device

    if matrix_device(m) != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def check_resume(rows: list[dict], m, path, passes: list[dict] = (), commit=_THIS_PROCESS, gpu=_THIS_PROCESS) -> None:
    """`--resume` continues one run: every row it keeps must be a cell of this matrix, measured with the
    same steps and passes, every computed setting, the same plan (poros's schedule settings), the same
    stack, the same GPU model (`gpu`: its name, default this process's) and the same commit as this run
    (`passes`: the pass log's records, held to the commit too); anything else would be mixed into its
    results and stand in for cells it never ran.

    Raises:
        PorosError: naming the first cell that differs, what differs, and what to do.
    """
    from poros.harness.cells import cell_config, matrix_cells
    from poros.harness.results import point_id, row_key

    other = sorted({str(r.get("matrix")) for r in rows if r.get("matrix") != m.name})
    if other:
        raise PorosError(f"--resume: {path} holds rows of matrix {', '.join(map(repr, other))}, this run is "
                         f"{m.name!r}; resume with that matrix, or pass another -o")
    differ = sorted({(r.get("steps"), r.get("passes")) for r in rows} - {(m.steps, m.passes)}, key=str)
    if differ:
        steps, passes = differ[0]
        raise PorosError(f"--resume: {path} has rows of {steps} steps x {passes} passes, this run would measure "
                         f"{m.steps} x {m.passes}; pass --steps {steps} --passes {passes}, or another -o")
    cells = {c.key: c for c in matrix_cells(m) if c.method is not None}
    gpu = this_gpu(m) if gpu is _THIS_PROCESS else gpu
    fix = "restore the matrix as it was, or pass another -o (a new run keeps nothing of the old)"
    for n, r in enumerate(rows, 1):
        cell = cells.get(row_key(r))
        what = f"{r.get('model')} {r.get('method')}" + (f" plan {r['plan_name']}" if r.get("plan_name") else "") + \
            (f" at {point_id(r['sweep'])}" if isinstance(r.get("sweep"), dict) and r["sweep"] else "")
        if cell is None:
            raise PorosError(f"--resume: {path}:{n} holds {what} (stack {r.get('stack_name')}), a cell this matrix "
                             f"does not have (a swept value, plan, model or method changed); {fix}")
        want = json.loads(json.dumps(config_for(cell.method, cell_config(m, cell)).as_dict()))
        names = COMPUTED_NAMES + (SCHEDULE_NAMES if cell.method is Method.POROS else ())
        have = r.get("config") if isinstance(r.get("config"), dict) else {}
        changed = [f"{k}: the rows have {have.get(k)!r}, the matrix {want.get(k)!r}" for k in names
                   if k in have and have.get(k) != want.get(k)]
        if changed:
            raise PorosError(f"--resume: {path}:{n} ({what}) was measured with other settings "
                             f"({'; '.join(changed)}); {fix}")
        if r.get("stack") != cell.stack.label():
            raise PorosError(f"--resume: {path}:{n} ({what}) ran on stack {r.get('stack')!r}, this environment is "
                             f"{cell.stack.label()!r}; resume on that stack, or {fix}")
        ran_on = ((r.get("provenance") or {}).get("gpus") or [{}])[0].get("name")
        if ran_on and gpu and ran_on != gpu and have.get("device") != "cpu":
            raise PorosError(f"--resume: {path}:{n} ({what}) ran on an {ran_on}, this GPU is an {gpu}: one run's "
                             f"rows compare on one GPU model; resume on an {ran_on}, or pass another -o")
    if commit is _THIS_PROCESS:
        from poros.provenance import current_commit

        commit = current_commit()
    check_same_commit(rows, path, commit)
    check_same_commit(list(passes), passes_path(path), commit)


def check_reference(path) -> None:
    """A `--reference` file must be a readable CSV with the reference columns.

    Raises:
        PorosError: naming the file and what is wrong with it.
    """

    p = Path(path)
    if p.is_dir():
        raise PorosError(f"--reference {path} is a folder, expected a CSV file (seed_reference.csv format)")
    if p.is_file():
        try:
            p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise PorosError(f"--reference {path}: not a CSV file (byte {e.start} is not UTF-8 text)") from None
    try:
        load_reference(p)
    except PorosError:
        raise
    except ValueError as e:  # pandas' parser errors
        raise PorosError(f"--reference {path}: not a readable CSV ({str(e).splitlines()[0][:160]})") from None


def check_runnable(m, device: str) -> None:
    """Refuse a matrix none of whose cells can run here (every stack pinned to other versions, or
    every model too large for this device), before an output folder fills with skipped cells.

    Raises:
        CapabilityError: with the first reason.
    """
    from poros.harness.cells import model_unavailable

    stacks = [s.mismatch() for s in m.stacks]
    if all(stacks):
        raise CapabilityError(f"{m.source}: no cell can run here: {stacks[0]}")
    models = [model_unavailable(x, device) for x in m.models]
    if all(models):
        raise CapabilityError(f"{m.source}: no cell can run here: {models[0]}")
    check_matrix_ranks(m, device)


def rank_problems(m, device: str) -> list[str]:
    """The most ranks a cell of matrix `m` runs on against what `device` gives on this host (`ranks_problem`), named
    where the count comes from (`gpus`, `sweep.gpus`)."""
    swept = any(k == "gpus" for k, _ in m.sweep)
    problem = ranks_problem(m.most_ranks(), device)
    return [f"{'sweep.gpus' if swept else 'gpus'}: {problem}"] if problem else []


def cpu_rank_problems(m) -> list[str]:
    """`rank_problems` of a matrix that runs on the CPU (its `device`, else this host's): its ranks are processes of
    the host that reads the file, so `poros validate` says what `poros bench` would. A CUDA matrix's GPUs are counted
    where it runs (`check_matrix_ranks`): a file may be meant for another machine."""
    from poros.harness.cells import matrix_device

    device = matrix_device(m)
    return rank_problems(m, device) if device == "cpu" else []


def check_matrix_ranks(m, device: str) -> None:
    """`rank_problems` as an error, where the run starts: `gpus` CUDA devices on this host, or cores for CPU ranks.

    Raises:
        CapabilityError: naming the matrix, the count asked, what the host has and the most it takes.
    """
    problems = rank_problems(m, device)
    if problems:
        raise CapabilityError(f"{m.source}: {problems[0]}")


# Data-parallel ranks on the CPU are processes of this host, each a Python process with its own trainers and
# threads (launch_env gives each cores // ranks, at least one). Up to a few a core they take turns and a gate ends
# (eight tiny-model ranks pass the gate on two cores); far beyond, a step's collectives wait on every rank's turn and
# the run crawls or never ends. A rank count above this many per usable core is refused before any rank starts.
CPU_RANKS_PER_CORE = 4


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: taskset, a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def ranks_problem(gpus: int, device: str) -> str | None:
    """Why `gpus` data-parallel ranks cannot run here (None: they can): on CUDA they need as many devices on this
    host; on the CPU, where they are processes, at most CPU_RANKS_PER_CORE a usable core."""
    if gpus <= 1:
        return None
    if device.startswith("cuda"):
        import torch

        if gpus > torch.cuda.device_count():
            return (f"{gpus} data-parallel ranks need {gpus} CUDA GPUs; this host has {torch.cuda.device_count()}: "
                    f"set gpus to {max(torch.cuda.device_count(), 1)} or less")
        return None
    cores = usable_cores()
    most = CPU_RANKS_PER_CORE * cores
    if gpus > most:
        return (f"{gpus} data-parallel ranks on the CPU are {gpus} processes; this host gives this process {cores} "
                f"CPU core(s), and a CPU run takes at most {CPU_RANKS_PER_CORE} ranks a core: set gpus to {most} or "
                "less")
    return None


def check_ranks(gpus: int, device: str, where: str) -> None:
    """`ranks_problem` as an error.

    Raises:
        CapabilityError: `where`, then the count asked, what the host has and the most it takes.
    """
    problem = ranks_problem(gpus, device)
    if problem:
        raise CapabilityError(f"{where}: {problem}")
