"""A matrix cell on several data-parallel ranks (`gpus: N`): `poros bench` starts N processes with torchrun
(`run_ranks`), each runs this module's `main` on its share of every step (poros.engine.parallel.distributed), and rank 0
reports the gate's result or the measurement as one JSON file the bench turns into a results row."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from poros.common.atomic import write_atomic
from poros.config import Method, TrainConfig
from poros.engine.parallel.distributed import (
    MULTICAST_OFF,
    barrier,
    close_world,
    init_world,
    largest,
    share_store,
)
from poros.engine.parallel.launch import LAUNCH_ENV
from poros.engine.methods.registry import make_trainer
from poros.engine.verify.parity import parity
from poros.engine.methods.trainer import set_cublas_workspace
from poros.errors import CapabilityError
from poros.harness.timing import PEAKS, measure
from poros.harness.child import emit

RANK_ENV = (*LAUNCH_ENV, "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # what a launcher sets for its ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(ranks: int) -> list[str]:
    """The command that starts `ranks` processes of this host (what follows is the program and its arguments)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port())]


def launch_env(ranks: int) -> dict[str, str]:
    """This process's environment for ranks it starts: no rank variables of its own, NVLink multicast off,
    the host's CPU threads shared out (torchrun would give each rank one)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update({k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    return env


PASS = "POROS_RANKS_PASS "  # rank 0: a timed pass of a measured cell ended
WARM = "POROS_RANKS_WARM "  # rank 0: a warm-up pass ended


def run_ranks(spec: dict, ranks: int, log=print, benchmark=None, budget=None) -> dict:
    """Run `spec` (kind "gate" or "measure", the config, the methods, steps) on `ranks` processes of this
    host; returns rank 0's report. Every line the ranks print goes to `log` as it comes. A measured cell's
    passes are rounds of the timed-pass loop every method runs (`timed_rounds`: with `benchmark`,
    pytest-benchmark's), each closed as rank 0 reports the pass; the report's `per_pass_s` are those rounds. The
    ranks are stopped where `budget` (poros.harness.budget.TimeBudget) runs out while they run (OutOfTime).

    Raises:
        CapabilityError: the ranks failed, with the last lines they printed.
    """
    from poros.harness.timing import timed_rounds
    from poros.harness.child import EOF_EVENT, ChildLines

    with tempfile.TemporaryDirectory(prefix="poros-ranks-") as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = torchrun(ranks) + ["-m", "poros.harness.ranks", json.dumps(spec), str(out)]
        proc = subprocess.Popen(cmd, env=launch_env(ranks), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            lines = ChildLines(proc, {PASS: "pass", WARM: "warm"}, log, show=lambda x: "  ranks| " + x, budget=budget,
                               what=f"the {ranks} data-parallel ranks")

            def failed() -> CapabilityError:
                proc.wait()
                lines.join()
                errors = [t for t in lines.tail if "Error" in t] or lines.tail
                return CapabilityError(f"{ranks} data-parallel ranks failed (exit {proc.returncode}): "
                                       + " | ".join(errors[-4:]))

            rounds: list[float] = []
            if spec["kind"] == "measure":
                def run(i: int) -> None:
                    kind, _ = lines.next()
                    if kind != ("warm" if i < spec["warmup"] else "pass"):
                        raise failed()

                timed_rounds(benchmark, run, spec["warmup"], spec["passes"],
                             done=lambda i, seconds: seconds is not None and rounds.append(seconds))
            while lines.next()[0] != EOF_EVENT:
                pass
            if proc.wait() != 0 or not out.is_file():
                raise failed()
            report = json.loads(out.read_text())
        finally:
            if proc.poll() is None:  # torchrun passes SIGTERM on to its ranks; SIGKILL would leave them running
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if rounds:
            report["measurement"]["per_pass_s"] = rounds
        return report


def main(argv: list[str]) -> int:
    spec, out = json.loads(argv[0]), Path(argv[1])

    values = dict(spec["config"])
    cfg = TrainConfig.from_settings(values, model=values.pop("model"))
    if cfg.deterministic:
        set_cublas_workspace()  # before CUDA starts
    import torch


    world = init_world(cfg.device.value)
    if world.size != cfg.gpus:
        raise CapabilityError(f"gpus: {cfg.gpus} but {world.size} ranks were started")
    try:
        store, _ = share_store(cfg.model, seed=cfg.seed, device=cfg.device.value, world=world,
                               double_quant=cfg.double_quant)
        if spec["kind"] == "gate":
            result = parity(cfg, steps=spec["steps"], store=store, method=Method(spec["method"]),
                            reference=Method(spec["reference"]), sequential=spec["sequential"], world=world)
            report = asdict(result)
        else:
            trainer = make_trainer(Method(spec["method"]), store, cfg, world)
            plan = None if trainer.plan is None else trainer.plan.summary()
            if cfg.device.value == "cuda":
                torch.cuda.reset_peak_memory_stats()
            # rank 0 reports each pass as it ends: the parent's rounds close on them
            say = emit if world.main else (lambda marker, rec: None)
            meas = measure(trainer, cfg, spec["steps"], spec["passes"], spec["warmup"], label=spec["method"],
                           on_pass=lambda rec: say(PASS, {"seconds": rec["seconds"]}),
                           on_warmup=lambda seconds: say(WARM, {"seconds": seconds}))
            for k in PEAKS:  # the largest rank's
                setattr(meas, k, largest(getattr(meas, k), world))
            alone = None
            if cfg.shard_stream and trainer.plan is not None:  # the one-GPU figure `scaling` divides by: the same
                if world.main:  # plan on rank 0 by itself, every byte over its own link (the others wait)
                    with trainer.alone():
                        alone = asdict(measure(trainer, cfg, spec["steps"], spec["passes"], spec["warmup"],
                                               label=f"{spec['method']} alone"))
                barrier(world)
            report = {"measurement": asdict(meas), "plan": plan, "arch": store.config.model_type, "alone": alone}
            trainer.close()
        if world.main:
            write_atomic(out, json.dumps(report, default=str), "rank 0's report")
    finally:
        close_world()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
