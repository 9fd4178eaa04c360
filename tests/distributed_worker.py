"""One rank of the data-parallel checks (tests/engine/test_distributed.py runs it under torchrun on the CPU, gloo):
poros against resident QLoRA under DistributedDataParallel, a negative control that leaves one layer's
gradients unreduced, and the host's shared store; with `shard`, the shared stream (shard_stream: each rank
copies its share of every streamed block, an all-gather completes it) against the same reference, a negative
control whose gather leaves the other ranks' share stale, and the bytes each rank copies and gathers; with
`order`, one step of poros and of resident_gc_offload against resident and a negative control whose reducer
adds the ranks in reverse order, on every world from the ranks launched down to two (`fewer_ranks`: one launch,
one store). Rank 0 writes one JSON object to the path given.

    torchrun --nproc-per-node 2 tests/distributed_worker.py OUT.json tiny-qwen3 [cpu|cuda] [shard|order]"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from poros.config import Method, TrainConfig
from poros.engine.planning import plan as P
from poros.engine.distributed import World, close_world, init_world, share_store
from poros.engine.methods import make_trainer
from poros.engine.parity import parity


def main(out: Path, model: str, device: str, mode: str = "") -> None:
    world = init_world(device)
    store, _ = share_store(model, seed=0, device=device, world=world)
    # math attention: the same kernels run to run on CUDA too (seq 64: bitsandbytes' CPU kernels need >= 64 tokens)
    cfg = TrainConfig(model=model, seq_len=64, grad_accum=2, block_size=2, device=device, attention="math")
    if mode == "order":  # each world from the launched one down to two ranks; the ranks left out are done
        report = {"world_size": world.size, "worlds": {}}
        while True:
            report["worlds"][world.size] = rank_order(cfg.replace(grad_accum=1), store, world)
            if world.size == 2 or (world := fewer_ranks(world, world.size - 1)) is None:
                break
    else:
        report = shared_stream(cfg, store, world) if mode == "shard" else data_parallel(cfg, store, world, device)
        report = {"world_size": world.size, **report}
    if world is not None and world.main:
        out.write_text(json.dumps(report))
    close_world()


def fewer_ranks(world: World, size: int) -> World | None:
    """The first `size` ranks go on as a world of their own (a new default process group, over the launcher's
    store); the others get None and are done. Every rank keeps the store it mapped."""
    dist.barrier()
    dist.destroy_process_group()
    if world.rank >= size:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"world{size}/", store), rank=world.rank,
                            world_size=size)
    return World(world.rank, size, world.local_rank, size)


def data_parallel(cfg, store, world, device) -> dict:
    maps = Path("/proc/self/maps").read_text()
    checksum = torch.tensor([int(store.arena[::4096].sum()), int(store.arena.sum())], dtype=torch.int64,
                            device=device)
    sums = [torch.zeros_like(checksum) for _ in range(world.size)]
    dist.all_gather(sums, checksum)
    gate = parity(cfg, steps=2, store=store, world=world)
    losses = [None] * world.size  # each rank's own micro-batch losses: its share of the step's data
    dist.all_gather_object(losses, gate.losses)
    micro = parity(cfg.replace(accumulation="micro"), steps=1, store=store, world=world)
    # a VRAM budget that keeps some layers resident and streams the rest (3 of tiny-qwen3's 5 at seq 64)
    budget = parity(cfg.replace(vram_budget="3.45MB"), steps=1, store=store, world=world)

    def unreduced(ref, mine):  # negative control: layer 0's gradients stay this rank's own
        mine.reducer.skip = frozenset({0})

    control = parity(cfg, steps=1, store=store, world=world, mutate=unreduced)
    return {"gate": gate.__dict__, "micro": micro.__dict__, "budget": budget.__dict__, "control": control.__dict__,
            "arena_shared": "poros-store-arena" in maps, "dense_shared": "poros-store-dense" in maps,
            "checksums_equal": all(torch.equal(s, sums[0]) for s in sums), "losses": losses,
            "pinned": device == "cuda" and store.pinned}


def rank_order(cfg, store, world) -> dict:
    """One step of poros and of resident_gc_offload (DDP, checkpointed layers, inputs in host memory) against
    resident under DDP, and the control: poros's reducer adding the ranks in reverse order, which from three
    ranks on gives other bits (with two, a + b == b + a)."""
    gate = parity(cfg, steps=1, store=store, world=world)
    offload = parity(cfg, steps=1, store=store, world=world, method=Method.RESIDENT_GC_OFFLOAD)

    def reversed_order(ref, mine):
        mine.reducer.order = mine.reducer.order[::-1]

    control = parity(cfg, steps=1, store=store, world=world, mutate=reversed_order)
    return {"gate": gate.__dict__, "offload": offload.__dict__, "control": control.__dict__}


def shared_stream(cfg, store, world) -> dict:
    cfg = cfg.replace(shard_stream=True, gpus=world.size)
    gate = parity(cfg, steps=2, store=store, world=world)  # every layer streamed, the lm_head through a buffer
    micro = parity(cfg.replace(accumulation="micro"), steps=1, store=store, world=world)
    budget = parity(cfg.replace(vram_budget="3.45MB"), steps=1, store=store, world=world)  # some layers resident

    def stale(ref, mine):  # negative control: the first group the step loads keeps the others' share stale
        mine.buffers.stale = frozenset({next(op.group for op in mine.plan.step if op.kind == P.LOAD)})

    control = parity(cfg, steps=1, store=store, world=world, mutate=stale)
    trainer = make_trainer(Method.POROS, store, cfg, world)
    plan = trainer.plan
    shared = trainer.step().counters
    with trainer.alone():  # the same plan on this rank alone: every byte over its own link, no gather
        alone = trainer.step().counters
    trainer.close()
    counters = [None] * world.size
    dist.all_gather_object(counters, {"shared": shared, "alone": alone,
                                      "h2d_planned": sum(plan.op_bytes(op, world.rank) for op in plan.step)})
    return {"gate": gate.__dict__, "micro": micro.__dict__, "budget": budget.__dict__, "control": control.__dict__,
            "counters": counters, "plan": plan.summary(),
            "unshared_h2d": replace(plan, shards=1).h2d_bytes_per_step, "gathers": sum(
                op.kind in (P.GATHER, P.GATHER_HEAD) for op in plan.step)}


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "cpu",
         sys.argv[4] if len(sys.argv) > 4 else "")
