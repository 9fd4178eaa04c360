"""The matrix suite: per model × stack the parity gate, then per method the timed passes.

The gate compares the matrix's method (poros) with its reference (`poros.engine.methods.gate_of`): resident
QLoRA, or resident with gradient checkpointing in a matrix without plain resident (long context, where
the two are run one after the other, the reference's states recorded in host memory).

Run: pytest suites/ --matrix=cpu   (or b300, a100, h200, a path; --steps/--passes for quick runs)
"""

from __future__ import annotations

import pytest

from poros.harness.bench import free_device_memory, measure, model_unavailable, progress, record, train_config
from poros.config import Method
from poros.engine.methods import METHODS, config_for, gate_of, make_trainer, method_unavailable

pytestmark = pytest.mark.bench


def _announce(session, cell):
    session.index += 1
    progress(f"[cell {session.index}/{session.total}] {cell.id}")


def _skip_if_not_runnable(session, cell):
    why = cell.stack.mismatch() or model_unavailable(cell.model, session.device)
    if why:
        pytest.skip(why)
    if cell.method is not None:
        why = method_unavailable(cell.method, session.device)
        if why:
            pytest.skip(why)
        gpus = session.matrix.settings_for(cell.model).get("gpus", 1)
        if gpus > 1 and not METHODS[cell.method].in_process:
            pytest.skip(f"{cell.method.value} runs as one process: gpus: {gpus} is for the in-process methods")


def _gate(session, cell):
    """The parity outcome of this model × stack, run once; a gate that raised raises again for
    every cell that needs it, without running again."""
    key = (cell.model, cell.stack.name)
    if key not in session.gates:
        from poros.engine.parity import parity

        cfg = train_config(session.matrix, cell.model)
        reference, method = gate_of(session.matrix.methods)
        sequential = reference is Method.RESIDENT_GC
        try:
            if cfg.gpus > 1:  # data-parallel ranks, started with torchrun; each gates its own states
                from poros.engine.parity import ParityResult
                from poros.harness.ranks import run_ranks

                spec = {"kind": "gate", "config": cfg.as_dict(), "method": method.value, "reference": reference.value,
                        "steps": session.parity_steps, "sequential": sequential}
                session.gates[key] = ParityResult(**run_ranks(spec, cfg.gpus, log=progress))
            else:
                session.gates[key] = parity(cfg, steps=session.parity_steps, store=session.stores.get(cell.model),
                                            method=method, reference=reference, sequential=sequential)
        except Exception as e:
            session.gates[key] = e
        free_device_memory()
    outcome = session.gates[key]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def test_parity(session, cell):
    _announce(session, cell)
    _skip_if_not_runnable(session, cell)
    done = session.writer.done(session.matrix.name) if session.resume else {}
    prior = [done.get((cell.model, cell.stack.name, m.value)) for m in gate_of(session.matrix.methods)]
    if all(prior):
        pytest.skip("already in results (--resume)")
    try:
        result = _gate(session, cell)
    except Exception as e:
        progress(f"  parity gate FAILED to run: {type(e).__name__}: {str(e)[:200]}")
        raise
    progress(f"  parity {result.parity} ({result.method} vs {result.gate}): {result.tensors_compared} tensors, "
             f"{result.steps} steps, first mismatch {result.first_mismatch}")
    assert result.ok, f"parity FAIL: first mismatching tensor {result.first_mismatch}, max |diff| {result.max_abs_diff:.3e}"


def test_step(session, cell, benchmark):
    _announce(session, cell)
    _skip_if_not_runnable(session, cell)
    m = session.matrix
    if session.resume and cell.key in session.writer.done(m.name):
        pytest.skip("already in results (--resume)")
    cfg = train_config(m, cell.model)
    try:
        _measure_cell(session, cell, cfg, benchmark)
    except AssertionError:  # a parity FAIL: its rows are written, saying FAIL
        raise
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
    pair = gate_of(m.methods)
    gate = _gate(session, cell) if pair is not None and cell.method in pair else None
    if cfg.gpus > 1:
        _measure_ranks(session, cell, cfg, benchmark, gate)
        return
    store = session.stores.get(cell.model)
    free_device_memory()
    if cfg.device.value == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()

    def write(meas, plan=None) -> None:
        _write(session, cell, cfg, benchmark, gate, meas, plan, store.config.model_type)

    if not METHODS[cell.method].in_process:  # Unsloth patches libraries globally: a child process
        from poros.harness.bench import Measurement
        from poros.engine.unsloth import measure_unsloth

        cfg = config_for(cell.method, cfg)  # the row records what it ran with

        # the row is written when the child reports, before the export is removed
        measure_unsloth(store, cfg, m.steps, m.passes, m.warmup_passes, log=progress, on_record=lambda child: write(
            Measurement(child["per_pass_s"], [], child["peak_vram_gb"], child["peak_vram_nvml_gb"],
                        peak_reserved_gb=child.get("peak_reserved_gb"))))
    else:
        trainer = make_trainer(cell.method, store, cfg)
        plan = None if trainer.plan is None else trainer.plan.summary()
        try:
            meas = measure(trainer, cfg, m.steps, m.passes, m.warmup_passes, benchmark=benchmark,
                           label=cell.method.value)
        finally:
            trainer.close()
            del trainer
            free_device_memory()
        write(meas, plan)
    if gate is not None:
        assert gate.ok, f"parity FAIL for {cell.model}: {gate.first_mismatch}"


def _write(session, cell, cfg, benchmark, gate, meas, plan, arch: str, alone=None) -> None:
    row = record(session.matrix, cell, cfg, meas, gate, reduced=session.reduced, arch=arch, plan=plan, alone=alone)
    session.writer.append(row)
    benchmark.extra_info.update({k: row[k] for k in (
        "s_per_step_median", "s_per_step_std", "tokens_per_s", "peak_vram_gb", "peak_vram_nvml_gb", "parity",
        "bytes_h2d_per_step", "copy_gbps", "copy_hidden_share")})
    progress(f"  {cell.method.value}: {row['s_per_step_median']:.4f} s/step, peak "
             f"{row['peak_vram_gb'] if row['peak_vram_gb'] is not None else '—'} GB")


def _measure_ranks(session, cell, cfg, benchmark, gate) -> None:
    """A data-parallel cell: the ranks time it (poros.harness.ranks) and rank 0's measurement is the row (as for
    Unsloth's child process, pytest-benchmark times nothing here)."""
    from poros.harness.bench import Measurement
    from poros.harness.ranks import run_ranks

    m = session.matrix
    spec = {"kind": "measure", "config": cfg.as_dict(), "method": cell.method.value, "steps": m.steps,
            "passes": m.passes, "warmup": m.warmup_passes}
    report = run_ranks(spec, cfg.gpus, log=progress)
    meas = Measurement(**report["measurement"])
    alone = Measurement(**report["alone"]) if report.get("alone") else None
    _write(session, cell, cfg, benchmark, gate, meas, report["plan"], report["arch"], alone)
    if gate is not None:
        assert gate.ok, f"parity FAIL for {cell.model}: {gate.first_mismatch}"
