"""Data parallelism over torch.distributed: each rank trains on its share of a step's micro-batches, the
LoRA gradients are averaged over the ranks, and every rank takes the same optimizer step.

Launch with `torchrun --nproc-per-node N poros ...` (any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT). NCCL on CUDA, gloo on the CPU.

- Resident QLoRA (resident_gc, resident_gc_offload) runs under torch's DistributedDataParallel, its buckets
  reduced by `rank_ordered_mean`: the reference.
- Poros reduces a layer's LoRA gradients as soon as the backward of its last micro-batch is enqueued
  (`GradReducer`), overlapped with the backward of the layers still to come.
- Exactness at any number of ranks: both multiply each rank's accumulated gradient by 1/world_size, gather
  every rank's product and add them in rank order 0, 1, ..., n-1 (`ordered_sum`), one element at a time. See
  "gradients" below for why not an all-reduce.
- One host copy of the store per host (`share_store`): the host's first rank builds it into shared memory
  (memfd) and the host's other ranks map the same pages, each pinning them for its own GPU.
- A shared stream (`shard_stream`): each rank copies its share of every streamed block from that host copy
  and the ranks all-gather the rest (poros/engine/buffers.py) in a process group of their own
  (`gather_group`), so the weights' gathers and the gradients' are two sequences of collectives, each
  issued in one order on every rank.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from poros.engine.launch import LAUNCH_ENV, launched
from poros.errors import CapabilityError, PorosError
from poros.store.arena import NF4Store
from poros.store.layout import align
from poros.store.build import build_store
from poros.store.progress import BuildStats

# NVLink multicast (NVLS) off for NCCL, symmetric memory and NVSHMEM, in this process and those it starts
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
IN_FLIGHT = 4  # layer gathers outstanding (at two ranks) before the oldest is waited for, summed and copied back


@dataclass(frozen=True)
class World:
    """Where this process sits: its rank among `size`, and among the `local_size` ranks of its host."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's contiguous share of a step's `size * k` items (rank r takes items r*k .. r*k+k-1)."""
        if len(items) % self.size:
            raise CapabilityError(f"{len(items)} micro-batches do not split over {self.size} ranks")
        k = len(items) // self.size
        return items[self.rank * k:(self.rank + 1) * k]


SINGLE = World()


def init_world(device: str) -> World:
    """Join the process group the launcher describes (NCCL for `cuda`, gloo for `cpu`); SINGLE when this
    process was not launched as one of several ranks. Idempotent.

    Raises:
        PorosError: a launch variable missing, or more ranks on a host than it has GPUs.
    """
    if not launched():
        return SINGLE
    env = os.environ
    missing = [k for k in LAUNCH_ENV if k not in env]
    if missing:
        raise PorosError(f"WORLD_SIZE={env['WORLD_SIZE']} but {', '.join(missing)} not set: launch with "
                         "torchrun --nproc-per-node N")
    for k, v in MULTICAST_OFF.items():
        env.setdefault(k, v)
    world = World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"]))
    if dist.is_initialized():
        return world
    if device == "cuda":
        have = torch.cuda.device_count()
        if world.local_size > have:
            raise PorosError(f"{world.local_size} ranks on this host but it has {have} CUDA device(s): use "
                             f"--nproc-per-node {have} or fewer")
        torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", world.local_rank))
    else:
        dist.init_process_group("gloo")
    return world


def gather_group(world: World):
    """A process group of every rank for the shared stream's gathers (every rank calls this, in the same
    order). Apart from the default group: the reducer launches its all-reduces from the backward's thread,
    the gathers come from the plan's, and one group's collectives must come in one order on every rank."""
    return dist.new_group(list(range(world.size)))


def release_group(group) -> None:
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def same_on_every_rank(value: str, world: World, what: str) -> None:
    """Raise unless every rank holds the same `value` (e.g. the plan whose copies they share).

    Raises:
        CapabilityError: naming the first rank that differs.
    """
    if not world.distributed:
        return
    values = [None] * world.size
    dist.all_gather_object(values, value)
    other = next((r for r, v in enumerate(values) if v != values[0]), None)
    if other is not None:
        raise CapabilityError(f"rank {other} runs another {what} than rank 0; the ranks must agree on it (give "
                              "every rank the same settings, and a fixed vram_budget rather than auto)")


def close_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# --- one host copy of the store -------------------------------------------------------------------

class SharedBytes:
    """Zeroed host bytes in an anonymous shared-memory file (memfd) that other processes of this host
    map by path (/proc/PID/fd/FD) while the creator keeps it open. The pages live while any process
    maps them: nothing is left behind when the ranks exit, however they exit."""

    def __init__(self, nbytes: int, name: str):
        self.nbytes = nbytes
        self.fd = os.memfd_create(name)
        try:
            os.ftruncate(self.fd, max(nbytes, 1))
            os.posix_fallocate(self.fd, 0, max(nbytes, 1))  # reserve now: a full host fails here, not later
        except OSError as e:
            os.close(self.fd)
            raise PorosError(f"cannot reserve {nbytes / 1e9:.1f} GB of shared host memory for the store "
                             f"({e.strerror}): "
                             "the host cannot hold one copy of it; free memory or use a larger machine") from None
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.tensor = map_shared(self.path, nbytes)

    def close(self) -> None:
        """Close the file (the mapping stays); call once every rank has mapped it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """`nbytes` of the shared file at `path`, mapped (MAP_SHARED) as a uint8 tensor."""
    try:
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except RuntimeError as e:
        raise PorosError(f"cannot map the host's shared store at {path} ({e}): every rank of a host must run as "
                         "the same user on the same machine") from None


def _host_group(world: World):
    """(gloo group of this host's ranks, global rank of its first rank); every rank creates every group."""
    hosts = [None] * world.size
    dist.all_gather_object(hosts, socket.gethostname())
    mine = None
    for host in dict.fromkeys(hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
        group = dist.new_group(ranks, backend="gloo")
        if host == hosts[world.rank]:
            mine = (group, ranks[0])
    return mine


def share_store(model, *, seed: int, device: str, world: World, progress: bool | None = None,
                double_quant: bool = False):
    """The NF4 store of `model` (a name, folder or poros.models.checkpoint.Source), one copy per host: built (or read)
    by the host's first rank into shared memory and mapped by the others. Without several ranks,
    `build_store` itself.

    Returns:
        (NF4Store, BuildStats); the other ranks' stats carry the build time of the first.
    """

    if not world.distributed:
        return build_store(model, seed=seed, device=device, progress=progress, double_quant=double_quant)
    group, leader = _host_group(world)
    if world.rank == leader:
        shared: list[SharedBytes] = []

        def allocate(nbytes: int) -> torch.Tensor:
            shared.append(SharedBytes(nbytes, "poros-store-arena"))
            return shared[-1].tensor

        try:
            store, stats = build_store(model, seed=seed, device=device, progress=progress, allocate=allocate,
                                       double_quant=double_quant)
            index, offset, seen = {}, 0, {}
            for name, t in store.dense.items():
                if t.data_ptr() in seen:
                    index[name] = seen[t.data_ptr()]
                    continue
                index[name] = seen[t.data_ptr()] = (offset, t.dtype, tuple(t.shape))
                offset = align(offset + t.numel() * t.element_size())
            dense_mem = SharedBytes(offset, "poros-store-dense")
            shared.append(dense_mem)
            dense = {name: _view(dense_mem.tensor, *where) for name, where in index.items()}
            for name, t in dense.items():
                t.copy_(store.dense[name])
            store.dense = dense
            meta = {"arena": (shared[0].path, store.nbytes), "dense": (dense_mem.path, offset), "index": index,
                    "config": store.config, "layers": store.layers, "code": store.code, "nested_code": store.nested_code, "source": store.source,
                    "buffers": store.buffers, "stats": stats}
        except Exception as e:
            dist.broadcast_object_list([{"error": f"{type(e).__name__}: {e}"}], src=leader, group=group)
            raise
        dist.broadcast_object_list([meta], src=leader, group=group)
        dist.barrier(group=group)  # every rank of the host has mapped both files
        for s in shared:
            s.close()
        return store, stats
    box = [None]
    dist.broadcast_object_list(box, src=leader, group=group)
    meta = box[0]
    if "error" in meta:
        raise PorosError(f"rank {leader} could not build the store for this host: {meta['error']}")
    arena = map_shared(*meta["arena"])
    dense_bytes = map_shared(*meta["dense"])
    dist.barrier(group=group)
    dense = {name: _view(dense_bytes, *where) for name, where in meta["index"].items()}
    stats: BuildStats = meta["stats"]
    store = NF4Store(meta["config"], meta["layers"], arena, dense, meta["code"], source=meta["source"],
                     buffers=meta["buffers"], nested_code=meta["nested_code"])
    return store, stats


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(shape)


# --- gradients ---------------------------------------------------------------------------------------
#
# Why no all-reduce: floating-point addition does not associate, and an all-reduce adds the ranks' values in an order
# of its own. Gloo's and NCCL's rings split the buffer into one chunk a rank and start each chunk's sum at another
# rank (NCCL's trees and its choice between the two depend on the size too), so an element's order of additions
# depends on where it falls in the buffer and how large that is, that is on how the tensors were grouped:
# DistributedDataParallel's buckets (25 MB, in reverse order of the parameters) and the reducer's layers give the same
# element other neighbours. With two ranks every element is one addition, a + b == b + a, and any grouping agrees;
# from three ranks on, (a + b) + c and a + (b + c) differ in the last bit and resident and poros no longer match. So
# both sides gather every rank's scaled gradient and add them in rank order (`ordered_sum`): each element is then
# ((g0 + g1) + g2) + ... on every rank, for every grouping, chunking and backend, and every rank holds the same bits.
#
# Cost, against the ring all-reduce it replaces: each rank receives the other ranks' (n - 1) x S bytes of a gradient
# of S bytes, where a ring all-reduce moves 2 (n - 1) / n x S: the same bytes at 2 ranks, n / 2 times as many beyond
# (4x at 8 ranks: 5.9 GB a step for qwen2.5-72b's 842 MB of LoRA gradients at rank 16, over NVLink beside the tens of
# GB a rank streams from host memory), and (n + 1) x S of device memory while a gather is in flight (a layer's in
# GradReducer, which keeps fewer in flight as n grows; a 25 MB bucket's under DDP). An all-to-all of one chunk a rank,
# the rank-ordered sum of each chunk and an all-gather of the sums would move the ring's bytes with the same bits, at
# the price of two dependent collectives a bucket.

def ordered_sum(parts: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """`parts[r]` added over the ranks r in `order` (default 0, 1, ..., n-1), one elementwise addition a rank:
    each element's sum is ((parts[0] + parts[1]) + parts[2]) + ..., whatever its position in the buffer."""
    order = tuple(range(len(parts))) if order is None else order
    total = parts[order[0]].clone()
    for r in order[1:]:
        total.add_(parts[r])
    return total


def rank_ordered_mean(state, bucket):  # no return annotation: DDP accepts none or the class itself, not a string
    """DistributedDataParallel's communication hook (`ddp.register_comm_hook(None, rank_ordered_mean)`): the
    bucket multiplied by 1/world_size, as DDP's own reduction multiplies it, every rank's product gathered and
    added in rank order, as `GradReducer` reduces a layer (the reason is above). `state`: unused (the default
    process group)."""
    n = dist.get_world_size()
    flat = bucket.buffer().mul_(1.0 / n)
    gathered = flat.new_empty(n * flat.numel())
    work = dist.all_gather_into_tensor(gathered, flat, async_op=True)
    # on CUDA the callback runs on a stream that waits for the gather, and the future records `gathered`'s
    # storage (its value) on that stream, so the sum reads it before the allocator hands it out again
    return work.get_future().then(lambda _: ordered_sum(gathered.view(n, -1)))


class GradReducer:
    """Per layer, the LoRA gradients reduced as `rank_ordered_mean` reduces DistributedDataParallel's buckets:
    flattened into one buffer, multiplied by 1/world_size, every rank's buffer gathered and added in rank order,
    copied back into `.grad`.

    `layer_done(i)` launches layer i's gather on the collective's stream, after the work enqueued so far on the
    compute stream (its backward); a few run while later layers' backward runs (`in_flight`: IN_FLIGHT layers
    at two ranks, fewer beyond, so that the gathered buffers in flight hold no more bytes than two ranks'
    would). `finish()` waits for the rest (before the optimizer step).
    """

    def __init__(self, layers: list[list[torch.nn.Parameter]], world: World, skip: frozenset = frozenset()):
        self.layers, self.world = layers, world
        self.scale = 1.0 / world.size
        self.skip = skip  # layers left unreduced: negative controls only
        self.order = tuple(range(world.size))  # the ranks' order in every sum; negative controls change it
        self.in_flight = max(1, IN_FLIGHT * 2 // world.size)
        self.pending: deque = deque()
        self.reduced: set[int] = set()
        self.bytes = 0

    def layer_done(self, i: int) -> None:
        if i in self.reduced:
            raise CapabilityError(f"layer {i}: gradients reduced twice in one step")
        self.reduced.add(i)
        if i in self.skip or not self.layers[i]:
            return
        grads = [p.grad for p in self.layers[i]]
        if any(g is None for g in grads):
            raise CapabilityError(f"layer {i}: a LoRA gradient is missing when its layer's backward is done")
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(self.scale)
        gathered = flat.new_empty(self.world.size * flat.numel())
        self.pending.append((i, gathered, dist.all_gather_into_tensor(gathered, flat, async_op=True)))
        self.bytes += flat.numel() * flat.element_size()
        while len(self.pending) > self.in_flight:
            self._copy_back()

    def _copy_back(self) -> None:
        i, gathered, work = self.pending.popleft()
        work.wait()
        flat = ordered_sum(gathered.view(self.world.size, -1), self.order)
        offset = 0
        for p in self.layers[i]:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def finish(self) -> None:
        """Every layer's reduced gradients in `.grad`; the next step starts afresh."""
        while self.pending:
            self._copy_back()
        missing = len(self.layers) - len(self.reduced)
        self.reduced.clear()
        if missing:
            raise CapabilityError(f"{missing} layer(s) finished the step without their gradients reduced")


def _maximum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def largest(value: float | None, world: World) -> float | None:
    """The largest rank's `value` (a peak), on every rank."""
    if value is None or not world.distributed:
        return value
    return _maximum(value)


def any_rank(flag: bool, world: World) -> bool:
    """Whether `flag` is set on some rank, on every rank (e.g. a Ctrl-C that reached the ranks at different
    steps: all stop together)."""
    return bool(_maximum(float(flag))) if world.distributed else flag


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def reduce_mean(value: float, world: World, device) -> float:
    """The mean of `value` over the ranks (a step's loss as every rank reports it), added in rank order."""
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = t.new_empty(world.size)
    dist.all_gather_into_tensor(gathered, t)
    return float(ordered_sum(gathered.view(world.size, 1))) / world.size


def agree(result, world: World):
    """A parity result that is PASS only if every rank's is: each rank gated its own states; the first
    failing rank's mismatch is named."""
    if not world.distributed:
        return result
    verdicts = [None] * world.size
    dist.all_gather_object(verdicts, (result.parity, result.first_mismatch, result.tensors_compared))
    result.ranks = [v[0] for v in verdicts]
    result.tensors_compared = sum(v[2] for v in verdicts)
    failed = next((r for r, v in enumerate(verdicts) if v[0] != "PASS"), None)
    if failed is not None:
        result.parity = "FAIL"
        result.first_mismatch = f"rank {failed}: {verdicts[failed][1]}"
    return result
