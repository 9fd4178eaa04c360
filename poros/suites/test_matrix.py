"""The matrix suite: per model × stack × sweep point the parity gate, then per method (poros per plan)
the timed passes.

The gate compares the matrix's gated method (poros) with its reference (`poros.engine.methods.registry.gate_of`):
resident QLoRA, or resident with gradient checkpointing in a matrix without plain resident (long
context, where the two are run one after the other, the reference's states recorded in host memory),
its layer inputs in host memory too (resident_gc_offload) in a matrix that lists only that.
One reference gates every plan: with several plans its states are recorded once, in host memory. A reference
recorded first is also kept in the run's folder as digests (gate-references/): where the gated side would end past
`--max-minutes`, the part stops after the reference's side and the next part (`--resume`) runs only the other.

Each timed pass is kept (OUT/passes.jsonl) as it ends, and each gate outcome: `--resume` continues a
cell after its last finished pass, and `--max-minutes` stops a run between passes.

Run: pytest suites/ --matrix=cpu   (or b300, a100, h200, a path; --steps/--passes for quick runs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import pytest

from poros.config import Method
from poros.errors import WriteError
from poros.harness import console
from poros.engine.methods.registry import METHODS, config_for, gate_of, make_trainer
from poros.harness.cell_memory import free_device_memory, frames_released, held_before, kept_failure
from poros.harness.cells import cell_config, computed_of, gate_config, gate_fingerprint, reference_fingerprint
from poros.harness.report.floor import compute_floors, floor_fields
from poros.harness.result_row import record
from poros.harness.timing import Measurement, OutOfTime, measure
from poros.harness.console import progress, stop_if_interrupted
from poros.provenance import this_gpu_uuid
from poros.suites.benchmarks import has_entry, rounds_from_row, row_info

pytestmark = pytest.mark.bench


def _announce(session, cell):
    session.index += 1
    progress(f"[cell {session.index}/{session.total}] {cell.id}")


def _skip_if_not_runnable(session, cell):
    why = session.unrunnable(cell)
    if why:
        pytest.skip(why)
    if session.out_of_time():
        session.stopped = True
        pytest.skip(f"time budget reached (--max-minutes {session.max_minutes:g}); --resume continues")
    if not session.ran:
        session.ran = True
        session.record_part()  # the part's first record: a lost machine still leaves its start and GPU


def _gate_plans(session) -> list:
    """The plans a gate holds to its reference: poros's plans where poros is the gated method (those of the
    poros cells selected with -k, where it selected some)."""
    pair = gate_of(session.matrix.methods)
    if not (pair and pair[1] is Method.POROS):
        return [None]
    return session.gate_plans or session.matrix.plan_names()


def _gate_fingerprint(session, cell, plan) -> str:
    return gate_fingerprint(session.matrix, cell, plan, session.parity_steps)


def _run_gate(session, cell) -> dict:
    """Run the gate of `cell`'s model × stack × point: {plan: ParityResult or the exception it raised}."""
    from poros.engine.verify.parity import ParityResult, holds_a_cap, parity, run_gate_recorded

    m = session.matrix
    reference, method = gate_of(m.methods)
    plans = _gate_plans(session)
    sequential = METHODS[reference].recorded
    out = {}
    cfgs = {plan: gate_config(m, cell, plan) for plan in plans}
    if cfgs[plans[0]].gpus > 1:  # data-parallel ranks, started with torchrun; each gates its own states
        from poros.harness.ranks import run_ranks

        for plan, cfg in cfgs.items():
            spec = {"kind": "gate", "config": cfg.as_dict(), "method": method.value, "reference": reference.value,
                    "steps": session.parity_steps, "sequential": sequential}
            try:
                out[plan] = ParityResult(**run_ranks(spec, cfg.gpus, log=progress, budget=session.budget))
            except OutOfTime:
                raise
            except Exception as e:
                out[plan] = kept_failure(e)
        return out
    store = session.stores.get(cell.model, cfgs[plans[0]].double_quant)
    if len(plans) == 1 and not (sequential or holds_a_cap(cfgs[plans[0]], method)):  # the two side by side
        try:
            out[plans[0]] = parity(cfgs[plans[0]], steps=session.parity_steps, store=store, method=method,
                                   reference=reference)
        except OutOfTime:
            raise
        except Exception as e:
            out[plans[0]] = kept_failure(e)
        return out
    # one reference for every plan: its states recorded in host memory once
    try:
        recorded = _reference(session, cell, store, reference, cfgs[plans[0]], len(plans))
    except (OutOfTime, WriteError):
        raise
    except Exception as e:
        return {plan: kept_failure(e) for plan in plans}
    for plan, cfg in cfgs.items():
        try:
            held_before(cfg.device.value)  # said where earlier cells or gates left device memory allocated
            trainer = make_trainer(method, store, cfg)
            try:
                out[plan] = run_gate_recorded(recorded, trainer)
            finally:
                trainer.close()
                del trainer
                free_device_memory()
        except OutOfTime:
            raise
        except Exception as e:
            out[plan] = kept_failure(e)
    return out


def _reference(session, cell, store, reference: Method, cfg, plans: int):
    """The reference's states for a gate recorded in host memory, and kept in the run's folder as digests
    (`DigestReference`, a `reference` record in the pass log): where the gated side of `plans` plans would end
    past the time budget, the part stops there (OutOfTime) and a later one (`--resume`) runs only that side,
    against the digests."""
    from poros.engine.verify.parity import record_reference
    from poros.engine.verify.parity_digest import DigestReference, DigestsRefused

    fingerprint = reference_fingerprint(session.matrix, cfg, session.parity_steps, reference)
    name, path = cell.id + "/reference", session.references / f"{fingerprint}.json.gz"
    kept = session.passlog.reference(name, fingerprint) if session.resume else None
    recorded = None
    if kept and path.exists():
        try:
            recorded, seconds = DigestReference.load(path, fingerprint, kept.get("checksum")), kept.get("seconds") or 0.0
            progress(f"  parity gate: {reference.value}'s states kept from an earlier part (--resume): {path.name}")
        except DigestsRefused as e:  # never the gated method's fault: its reference is recorded again
            progress(f"  parity gate: refused {e}; recording {reference.value}'s side again")
    if recorded is None:
        t0 = time.monotonic()
        recorded = record_reference(reference, store, cfg, session.parity_steps)
        checksum = DigestReference.of(recorded).save(path, fingerprint)
        seconds = time.monotonic() - t0
        session.passlog.add("reference", name, fingerprint, file=path.name, seconds=round(seconds, 1),
                            checksum=checksum)
    if session.budget is not None:
        session.budget.check(f"the gated side of the gate ({reference.value}'s side took {seconds:.0f} s and is kept)",
                             plans * seconds, margin=1.2, lower="parity_steps")
    return recorded


def _kept_gates(session, cell, plans: list) -> dict:
    """{plan: outcome an earlier part of this run recorded, or None} (empty where the run does not resume)."""
    if not session.resume:
        return {}
    kept = {plan: session.passlog.gate(cell.id + f"/{plan}", _gate_fingerprint(session, cell, plan)) for plan in plans}
    # a FAIL is gated again: a gate that failed once against a reference since refused, or on a machine since
    # changed, must not stick to the cell without being run again
    return {plan: r if r and r.get("parity") == "PASS" else None for plan, r in kept.items()}


def _gate_fits(session) -> None:
    """A gate to run must end within the time budget, judged by the longest gate this run recorded: one cut off
    by the caller's limit is lost."""
    if session.budget is None:
        return
    longest = max((r.get("seconds") or 0.0 for r in session.passlog.records() if r.get("kind") == "gate"), default=0.0)
    session.budget.check(f"a parity gate (the longest recorded took {longest:.0f} s)", longest or None, margin=1.2,
                         lower="parity_steps")


def _gate(session, cell, reference_only: bool = False) -> dict:
    """The gate outcomes of this cell's model × stack × point, run once per session and kept in the pass
    log (a resumed run reuses them, and runs none that would end past its time budget: OutOfTime); an outcome
    that raised raises again for every cell that needs it. `reference_only`: asked by the reference's cell,
    which takes part in every plan's gate, with no poros cell selected: the plans an earlier part gated suffice."""
    from poros.engine.verify.parity import ParityResult

    key = cell.gate_key
    if key not in session.gates:
        plans = _gate_plans(session)
        kept = _kept_gates(session, cell, plans)
        if reference_only and session.gate_plans is None and any(kept.values()):
            kept = {plan: r for plan, r in kept.items() if r}
        if kept and all(kept.values()):
            session.gates[key] = {plan: ParityResult(**r) for plan, r in kept.items()}
            progress("  parity gate: outcome kept from the earlier run (--resume)")
        else:
            try:
                _gate_fits(session)
                t0 = time.monotonic()
                # every optimizer step of the gate, the reference's once and each plan's, within the budget
                watch = session.budget.watch("the parity gate", session.parity_steps * (1 + len(plans)),
                                             "parity_steps") if session.budget is not None else contextlib.nullcontext()
                with console.phase("parity gate"), watch:
                    session.gates[key] = _run_gate(session, cell)
            except OutOfTime as e:
                if e.never:  # every cell of this gate is refused with it, without running it again
                    session.gates[key] = {plan: e for plan in plans}
                raise
            for plan, result in session.gates[key].items():
                if isinstance(result, ParityResult):
                    session.passlog.add("gate", cell.id + f"/{plan}", _gate_fingerprint(session, cell, plan),
                                        result=dataclasses.asdict(result), seconds=time.monotonic() - t0)
        free_device_memory()
    return session.gates[key]


def gate_for(session, cell):
    """The gate outcome `cell` took part in (None: it took part in none: unsloth, or a method whose
    computed settings differ from the gate's)."""
    pair = gate_of(session.matrix.methods)
    if pair is None or cell.method not in pair:
        return None
    if computed_of(cell_config(session.matrix, cell)) != computed_of(gate_config(session.matrix, cell, cell.plan)):
        return None
    outcomes = _gate(session, dataclasses.replace(cell, method=None, plan=None), reference_only=cell.method is pair[0])
    if cell.method is pair[1]:
        outcome = outcomes.get(cell.plan)
    else:  # the reference took part in every plan's gate: the first that failed, else the first
        ran = [o for o in outcomes.values() if not isinstance(o, Exception)]
        outcome = next((o for o in ran if not o.ok), ran[0] if ran else next(iter(outcomes.values())))
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _out_of_time(session, e: OutOfTime, where: str = ""):
    """A cell the time budget stopped: skipped, and the part stops there (`--resume` continues it); one that could
    not end within a whole budget fails, naming what to change (a part as long would stop it again)."""
    if e.never:
        raise pytest.fail.Exception(str(e), pytrace=False) from None
    session.stopped = True
    pytest.skip(f"time budget reached{' ' + where if where else ''} ({e}); --resume continues")


def test_parity(session, cell):
    _announce(session, cell)
    _skip_if_not_runnable(session, cell)
    m = session.matrix
    if session.resume:
        done = session.writer.done(m.name, timed=False)
        pair = gate_of(m.methods)
        members = [c for c in session.cells if c.gate_key == cell.gate_key and c.method in pair]
        if members and all(c.key in done for c in members):
            pytest.skip("already in results (--resume)")
    try:
        outcomes = _gate(session, cell)
    except OutOfTime as e:
        _out_of_time(session, e)
    failed = []
    for plan, result in outcomes.items():
        name = "" if plan is None else f" plan {plan}"
        if isinstance(result, Exception):
            progress(f"  parity gate{name} FAILED to run: {type(result).__name__}: {str(result)[:200]}")
            failed.append(f"{plan or 'gate'}: {type(result).__name__}: {str(result)[:200]}")
            continue
        progress(f"  parity{name} {result.parity} ({result.method} vs {result.gate}): {result.tensors_compared} "
                 f"tensors, {result.steps} steps, first mismatch {result.first_mismatch}")
        if not result.ok:
            failed.append(f"{plan or 'gate'}: parity FAIL: first mismatching tensor {result.first_mismatch}, "
                          f"max |diff| {result.max_abs_diff:.3e}")
    if len(failed) == 1 and len(outcomes) == 1 and isinstance(next(iter(outcomes.values())), Exception):
        raise next(iter(outcomes.values()))
    assert not failed, "; ".join(failed)


def test_step(session, cell, benchmark):
    _announce(session, cell)
    _skip_if_not_runnable(session, cell)
    m = session.matrix
    row = session.writer.done(m.name, timed=session.timed).get(cell.key) if session.resume else None
    if row is not None:
        # its benchmark entry, where the earlier part was lost before writing it, from the row
        written = not has_entry(session.config, benchmark) and rounds_from_row(benchmark, row)
        if written:
            benchmark.extra_info.update(row_info(row))
        pytest.skip("already in results (--resume)" + ("; its benchmark entry written from the row" if written else ""))
    cfg = config_for(cell.method, cell_config(m, cell))  # the row records what it ran with
    try:
        _measure_cell(session, cell, cfg, benchmark)
    except (AssertionError, WriteError):  # a parity FAIL: its rows are written, saying FAIL; a record that could not
        raise  # be written stops the run (poros/suites/plugin.py)
    except OutOfTime as e:
        done = len(session.passes(cell))
        _out_of_time(session, e, f"after {done} of {m.passes} passes")
    except KeyboardInterrupt:  # cut off (a chunk's time budget sends SIGINT): pytest-benchmark would
        benchmark.has_error = True  # put the half-run benchmark into its JSON and crash on its empty stats
        raise
    except Exception as e:  # nothing is lost: the failure is a row too (and --resume retries it)
        session.writer.append(record(m, cell, cfg, None, None, reduced=session.reduced, status="failed",
                                     error=f"{type(e).__name__}: {e}"[:500]))
        progress(f"  {cell.method.value}: FAILED ({type(e).__name__}: {str(e)[:200]})")
        raise


def _measure_cell(session, cell, cfg, benchmark):
    m = session.matrix
    gate = gate_for(session, cell)
    store = session.stores.get(cell.model, cfg.double_quant) if cfg.gpus == 1 else None
    arch = store.config.model_type if store is not None else ""

    def write(meas, plan=None, arch=arch, alone=None) -> None:
        _write(session, cell, cfg, benchmark, gate, meas, plan, arch, alone)

    if not session.timed:  # --benchmark-disable: the gate decides, nothing is timed
        write(None)
    elif cfg.gpus > 1:
        _measure_ranks(session, cell, cfg, gate, write, benchmark)
    elif not METHODS[cell.method].in_process:  # Unsloth patches libraries globally: a child process
        _measure_child(session, cell, cfg, store, write, benchmark)
    else:
        free_device_memory()
        held = held_before(cfg.device.value)
        fp = session.cell_fingerprint(cell)
        earlier = session.passes(cell) if session.resume else []
        if earlier:
            progress(f"  {cell.method.value}: {len(earlier)} of {m.passes} passes kept from the earlier run (--resume)")
        if earlier and session.budget is not None and len(earlier) < m.passes:
            session.budget.check("the trainer's set-up, warm-up and next pass",
                                 (earlier[-1].get("overhead_s") or 0.0) + earlier[-1]["seconds"])
        t_cell = time.monotonic()
        with console.phase("trainer set-up"), frames_released():
            trainer = make_trainer(cell.method, store, cfg)
        plan = None if trainer.plan is None else trainer.plan.summary()
        timed_s = []

        def on_pass(rec):  # the set-up and warm-up a process spent before its first timed pass, for the next part
            rec["overhead_s"] = time.monotonic() - t_cell - sum(timed_s) - rec["seconds"]
            timed_s.append(rec["seconds"])
            session.passlog.add("pass", cell.id, fp, **rec)

        try:
            with frames_released():
                meas = measure(trainer, cfg, m.steps, m.passes, m.warmup_passes, label=cell.method.value,
                               warmup_steps=m.warmup_pass_steps, earlier=earlier, budget=session.budget,
                               on_pass=on_pass, benchmark=benchmark, stop_after=session.passes_per_part)
        finally:
            trainer.close()
            del trainer
            free_device_memory()
        _unless_unfinished(session, len(meas.per_pass_s), benchmark)
        meas.held_before_gb = held
        write(meas, plan)
    if gate is not None:
        assert gate.ok, f"parity FAIL for {cell.model}: {gate.first_mismatch}"


def _unless_unfinished(session, done: int, benchmark) -> None:
    """A cell whose passes so far are those this part runs of it (`--passes-per-part`) and fewer than the matrix's:
    skipped without a row (its passes are in the pass log, and no statistics of it in benchmark.json), the run goes
    on to the next cell and ends with exit 75; `--resume` continues it, on any GPU."""
    m = session.matrix
    if done >= m.passes:
        return
    session.unfinished = True
    if benchmark is not None:
        benchmark.has_error = True  # pytest-benchmark keeps no statistics of a cell without its every pass
    pytest.skip(f"{done} of {m.passes} passes timed (--passes-per-part {session.passes_per_part} a part); "
                "--resume continues")


def _room_for_child(session, store, cfg):
    """What gives the Unsloth child the host memory its offloaded activations take, where the host has less free
    (with MEMORY_HEADROOM) than they need: the store's release (the child loads its export; a later cell builds the
    store again). None where the host has room, or does not say."""
    from poros.harness.unsloth import offloaded_bytes
    from poros.store.host_memory import MEMORY_HEADROOM, available_host_memory

    available, need = available_host_memory(), offloaded_bytes(store.config, cfg)
    if available is None or need * (1 + MEMORY_HEADROOM) <= available:
        return None

    def release():
        progress(f"  unsloth: the NF4 store's host memory given back for the child's offloaded activations "
                 f"({need / 1e9:.1f} GB; {available / 1e9:.1f} GB was available)")
        session.stores.release()
    return release


def _measure_child(session, cell, cfg, store, write, benchmark) -> None:
    """Unsloth, in a child process whose passes are rounds of the same timed-pass loop (kept in the pass log
    as each ends) and which a time budget stops between passes. A part of a run in parts starts no child
    whose load, warm-up and next pass would not fit, judged by the earlier parts' children."""
    from poros.harness.unsloth import measure_unsloth

    m = session.matrix
    fp = session.cell_fingerprint(cell)
    twin = _twin(session, cell, fp)
    if twin is not None:  # a swept setting this method does not run with: the same run, measured once
        cell_id, passes = twin
        progress(f"  {cell.method.value}: runs as {cell_id} ran (a swept setting it does not take): its passes")
        write(_child_measurement(passes, passes_of=cell_id))
        return
    earlier = session.passes(cell) if session.resume else []
    if len(earlier) < m.passes and session.budget is not None and earlier:
        session.budget.check("a child's start and next pass",
                             (earlier[-1].get("child_overhead_s") or 0.0) + earlier[-1]["seconds"])
    if len(earlier) < m.passes:
        stop_if_interrupted()
        t0 = time.monotonic()
        this = []

        def on_pass(rec):
            rec = {**rec, "index": len(earlier) + len(this), "counters": [], "gpu": this_gpu_uuid()}
            this.append(rec)
            rec["child_overhead_s"] = time.monotonic() - t0 - sum(r["seconds"] for r in this)
            session.passlog.add("pass", cell.id, fp, **rec)

        try:
            passes = m.passes if session.passes_per_part is None else min(m.passes,
                                                                          len(earlier) + session.passes_per_part)
            with console.phase("unsloth child"):
                measure_unsloth(store, cfg, m.steps, passes, m.warmup_passes, log=progress,
                                warmup_steps=m.warmup_pass_steps, on_pass=on_pass, keep_export=session.keep_exports,
                                benchmark=benchmark, earlier=earlier, budget=session.budget,
                                before_child=_room_for_child(session, store, cfg))
        finally:  # the child's passes count as timed passes, the rest of its time as the child's
            console.add_phase_time("timed passes", sum(r["seconds"] for r in this))
            console.add_phase_time("unsloth child", -sum(r["seconds"] for r in this))
        earlier = earlier + this
    _unless_unfinished(session, len(earlier), benchmark)
    write(_child_measurement(earlier))


def _child_measurement(passes: list[dict], passes_of: str | None = None) -> Measurement:
    """A child's Measurement from its passes' records: their seconds, the peaks over them, each pass's retries
    and GPU."""
    def peak(k):
        values = [r[k] for r in passes if r.get(k) is not None]
        return max(values) if values else None

    return Measurement([r["seconds"] for r in passes], [], peak("peak_vram_gb"), peak("peak_vram_nvml_gb"),
                       peak_reserved_gb=peak("peak_reserved_gb"), alloc_retries=[r.get("alloc_retries") for r in passes],
                       pass_gpus=[r.get("gpu") for r in passes], passes_of=passes_of)


def _twin(session, cell, fp: str) -> tuple[str, list[dict]] | None:
    """(cell id, passes) of an earlier cell of this run that ran this cell's method with this cell's settings,
    all its passes timed, None where none did: a child method that runs as its users run it takes no part of a
    swept setting (Unsloth under a compile or attention sweep), so each point's cell is the same run."""
    from poros.harness.cells import matrix_cells

    others = [c.id for c in matrix_cells(session.matrix) if c.method is cell.method and c.id != cell.id]
    for cell_id in others:
        passes = session.passlog.passes(cell_id, fp, session.matrix.passes)
        if len(passes) == session.matrix.passes:
            return cell_id, passes
    return None


def _write(session, cell, cfg, benchmark, gate, meas, plan, arch: str, alone=None) -> None:
    row = record(session.matrix, cell, cfg, meas, gate, reduced=session.reduced, arch=arch, plan=plan,
                 timed=meas is not None, alone=alone)
    row.update(floor_fields(row, compute_floors(session.writer.rows())))  # the run's reference has run by now
    session.writer.append(row)
    if meas is None:
        progress(f"  {cell.method.value}: not timed (--benchmark-disable)")
        return
    # every pass timed by an earlier process, lost before this row: no round ran in this one, the row's passes are them
    if benchmark.stats is None and not rounds_from_row(benchmark, row):
        benchmark.skipped = True
    benchmark.extra_info.update(row_info(row))
    shown = lambda v, f: "—" if v is None else f.format(v)  # noqa: E731
    floor = "" if row["floor_share"] is None else (f", floor share {row['floor_share']:.0%}, beyond the floor "
                                                   f"{row['host_s_per_step']:+.4f} s/step")
    if row.get("schedule_floor_s") is not None:
        floor += (f", schedule floor {row['schedule_floor_s']:.4f} s (the host beyond it "
                  f"{row['beyond_schedule_s']:+.4f} s)")
    progress(f"  {cell.method.value}: {shown(row['s_per_step_median'], '{:.4f}')} s/step, peak "
             f"{shown(row['peak_vram_gb'], '{:.2f}')} GB{floor}")
    if row.get("capture_errors"):
        progress(f"  {cell.method.value}: {row['capture_errors']} CUDA graph template(s) failed to capture; their "
                 f"layers ran eagerly ({row['template_fallbacks']} eager layer calls)")
    if row.get("alloc_retries_per_step"):
        progress(f"  {cell.method.value}: the allocator released its cache {row['alloc_retries_per_step']:g} times "
                 "a step (each waits for the device)")


def _measure_ranks(session, cell, cfg, gate, write, benchmark) -> None:
    """A data-parallel cell: its passes are rounds timed here as rank 0 reports them (poros.harness.ranks),
    the rest of rank 0's measurement is the row's. It resumes per cell, not per pass."""
    from poros.harness.ranks import run_ranks

    m = session.matrix
    spec = {"kind": "measure", "config": cfg.as_dict(), "method": cell.method.value, "steps": m.steps,
            "passes": m.passes, "warmup": m.warmup_passes}
    report = run_ranks(spec, cfg.gpus, log=progress, benchmark=benchmark, budget=session.budget)
    alone = Measurement(**report["alone"]) if report.get("alone") else None
    write(Measurement(**report["measurement"]), report["plan"], report["arch"], alone)
