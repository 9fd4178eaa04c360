"""What data parallelism on this host can expect, in seconds: NCCL all-reduce bandwidth between the ranks,
and the pinned host->device copy rate of one rank alone against every rank copying at once (poros streams
every layer through each GPU's own link from one shared host store: host memory bandwidth or the PCIe
topology may cap the scaling).

    torchrun --nproc-per-node 2 experiments/h200x2-copy-and-allreduce/probe_ranks.py [--gb 4] [--out probe.jsonl]

One JSON line per measurement (rank 0 prints; every rank's copy rate is gathered).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from poros.engine.parallel.distributed import close_world, init_world


def timed(fn, repeat: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="host buffer each rank copies (GB)")
    p.add_argument("--out")
    args = p.parse_args()
    world = init_world("cuda")
    rows = []

    def emit(row: dict) -> None:
        row = {"world_size": world.size, "gpu": torch.cuda.get_device_name(), **row}
        rows.append(row)
        if world.main:
            print(json.dumps(row), flush=True)

    for mb in (1, 16, 256, 1024):
        t = torch.ones(mb * 2**20 // 4, device="cuda")
        dist.all_reduce(t)
        s = timed(lambda: dist.all_reduce(t), 5)
        bus = 2 * (world.size - 1) / world.size * t.nbytes / s / 1e9  # NCCL's bus bandwidth convention
        emit({"probe": "all_reduce", "mb": mb, "seconds": s, "bus_gbps": bus})
    n = int(args.gb * 1e9)
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    for together in (False, True):
        dist.barrier()
        if together or world.main:
            s = timed(lambda: dev.copy_(host, non_blocking=True), 5)
            rate = n / s / 1e9
        else:
            rate = None
        dist.barrier()
        rates = [None] * world.size
        dist.all_gather_object(rates, rate)
        emit({"probe": "h2d_pinned", "ranks_copying": world.size if together else 1, "gb": args.gb,
              "gbps_by_rank": rates})
    if world.main and args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    close_world()


if __name__ == "__main__":
    main()
