"""The device side of a plan's weights: its buffers with the copies into them and the events that order
them (`DeviceBuffers`). Each layer's saved input, kept for its recompute, is poros/engine/runtime/saved_inputs.py's.

Copies run on their own stream, which the saved inputs' copies back share in the plan's order. Each buffer has a
`ready` event (recorded after a load) that the compute stream waits for on its first read, and a `free` event
(recorded at a release) that the next load into it waits for: every ordering comes from the plan, whose rules
`plan.check` verifies.

With a plan whose copies are shared among data-parallel ranks (`plan.shards`, shard_stream), a load
copies this rank's contiguous share of the bytes into its own slice of the buffer, and the gather that
follows it in the plan runs an all-gather in place over the buffer on a stream of its own, behind the
copy's event; the buffer's `ready` event then follows the gather. A rank that trains alone (`world`
SINGLE) copies every byte and skips the gathers: the same plan on one device.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from poros.engine.planning import plan as P
from poros.engine.parallel.distributed import SINGLE, World

HEAD_KEY = -1  # the lm_head's own region when it borrows no buffer


class DeviceBuffers:
    """The plan's buffers on the device, the copies into them and the events that order them."""

    def __init__(self, plan: P.Plan, store, device: torch.device, head_host: torch.Tensor, world: World = SINGLE,
                 group=None):
        """`world`, `group`: the ranks sharing the plan's copies and their process group for the gathers
        (with `plan.shards` > 1)."""
        self.plan, self.store, self.device = plan, store, device
        self.world, self.group = world, group
        self.stale: frozenset = frozenset()  # groups (HEAD_KEY: the lm_head) whose gather misses: negative controls
        self.cuda = device.type == "cuda"
        stream = [b for b in plan.buffers if not b.resident]
        size = stream[0].nbytes if stream else 0
        pad, h = plan.head_pad, plan.head_buffer
        # the rotating buffers in one region, the lm_head's pad (what it needs beyond a buffer) beside the buffer it
        # borrows: before the first, else right after its own
        offset = {b.index: b.index * size + (pad if h == 0 or (h is not None and b.index > h) else 0) for b in stream}
        self.region = torch.empty(len(stream) * size + pad, dtype=torch.uint8, device=device)
        self.views: dict[int, torch.Tensor] = {b.index: self.region[offset[b.index]: offset[b.index] + size]
                                               for b in stream}
        for b in plan.buffers:
            if b.resident:
                self.views[b.index] = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        self.head_host = head_host
        nbytes = head_host.numel() * head_host.element_size()
        if h is not None:
            o = 0 if h == 0 else offset[h]
            self.head_region = self.region[o: o + plan.gathered_size(nbytes)]  # the shares' padding included
        else:
            self.head_region = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.head = self.head_region[:nbytes].view(head_host.dtype).view(head_host.shape)
        self.ready, self.free = {}, {}
        self.fresh: set[int] = set()  # buffers loaded since the compute stream last waited for them
        # the saved inputs' copies back share the copy stream (None off CUDA, where every copy is synchronous)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.gather_stream = torch.cuda.Stream(device) if self.cuda and plan.shards > 1 else None
        self.reset_counters()

    def reset_counters(self) -> None:
        self.bytes_h2d = self.loads = self.bytes_gathered = 0
        self.copy_s = self.copy_wait_s = self.gather_s = 0.0
        self._copy_events, self._wait_events, self._gather_events = [], [], []

    def _share(self, nbytes: int) -> tuple[int, int]:
        """The byte range of an `nbytes` streamed copy this rank loads: its share, or all when it has no peers."""
        if self.plan.shards == 1 or self.world.size == 1:
            return 0, nbytes
        return self.plan.shard(nbytes, self.world.rank)

    def _copy(self, key: int, dst: torch.Tensor, src: torch.Tensor, after: tuple[int, ...] = ()) -> None:
        """Copy host->device on the copy stream once the readers of `key` (and of `after`) are done;
        `key`'s ready event follows the copy."""
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                for k in (key, *after):
                    if k in self.free:
                        self.copy_stream.wait_event(self.free[k])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.copy_stream)
                dst.copy_(src, non_blocking=True)
                end.record(self.copy_stream)
                self.ready[key] = end
                self._copy_events.append((start, end))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.copy_s += time.perf_counter() - t0
            self.copy_wait_s = self.copy_s  # synchronous: every copy is waited for
        self.fresh.add(key)
        self.bytes_h2d += src.numel() * src.element_size()

    def load(self, op: P.Op) -> None:
        g = self.plan.groups[op.group]
        lo, hi = (0, g.nbytes) if g.resident else self._share(g.nbytes)
        self._copy(op.buffer, self.views[op.buffer][lo: hi], self.store.arena[g.start + lo: g.start + hi])
        self.loads += 1

    def load_head(self, op: P.Op | None) -> None:
        """The lm_head weight into its region: a lent buffer (`op.buffer`; this rank's share of it when the
        plan shares copies) or its own (`op` None: resident, copied whole once)."""
        lent = () if op is None or op.buffer < 0 else (op.buffer,)
        if op is None or self.plan.shards == 1:
            self._copy(HEAD_KEY, self.head, self.head_host.detach(), after=lent)
            return
        lo, hi = self._share(self.plan.head_bytes)
        host = self.head_host.detach().reshape(-1).view(torch.uint8)
        self._copy(HEAD_KEY, self.head_region[lo: hi], host[lo: hi], after=lent)

    def gather(self, op: P.Op) -> None:
        """The other ranks' shares of the group just loaded into buffer `op.buffer`."""
        self._gather(op.buffer, self.views[op.buffer], self.plan.groups[op.group].nbytes, op.group in self.stale)

    def gather_head(self, op: P.Op) -> None:
        self._gather(HEAD_KEY, self.head_region, self.plan.head_bytes, HEAD_KEY in self.stale)

    def _gather(self, key: int, region: torch.Tensor, nbytes: int, stale: bool) -> None:
        """All-gather every rank's share of an `nbytes` copy in place over `region` (each rank's share is its
        own slice of it), behind the copy of this rank's share; `key`'s ready event follows the gather."""
        if self.world.size == 1:
            return  # alone: its load copied every byte
        n, r, s = self.world.size, self.world.rank, self.plan.shard_size(nbytes)
        out = region[: n * s]
        mine = out[r * s: (r + 1) * s]
        if stale:  # the collective runs on every rank, but the others' shares never reach the buffer
            out = torch.empty_like(out)
        if self.cuda:
            with torch.cuda.stream(self.gather_stream):
                self.gather_stream.wait_event(self.ready[key])
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.gather_stream)
                # the collective's own stream waits for this one at launch; wait() orders this one after it
                dist.all_gather_into_tensor(out, mine, group=self.group, async_op=True).wait()
                end.record(self.gather_stream)
            self.ready[key] = end
            self._gather_events.append((start, end))
        else:
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(out, mine, group=self.group)
            self.gather_s += time.perf_counter() - t0
        self.fresh.add(key)
        self.bytes_gathered += (n - 1) * s

    def acquire(self, key: int) -> None:
        """Make the compute stream wait for the last load into buffer `key` (once per load)."""
        if key not in self.fresh:
            return
        self.fresh.discard(key)
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(self.ready[key])
            after.record(stream)
            self._wait_events.append((before, after))

    def release(self, key: int) -> None:
        """Work reading buffer `key` is enqueued: a load into it may follow once that work is done."""
        if self.cuda:
            event = self.free.get(key) or torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.free[key] = event

    def counters(self, deferred: bool = False) -> dict:
        """Bytes and copies since `reset_counters`, and the seconds the copies, the compute stream's waits for them
        and the gathers took on the device; `deferred`: those seconds left to `resolved`, which waits for the
        events only when the counters are read (no synchronization where the caller goes on enqueueing)."""
        out = {"bytes_h2d": self.bytes_h2d, "block_copies": self.loads, "copy_s": self.copy_s,
               "copy_wait_s": self.copy_wait_s}
        if self.plan.shards > 1:
            out.update(bytes_gathered=self.bytes_gathered, gather_s=self.gather_s)
        if self.cuda and (self._wait_events or self._copy_events or self._gather_events):
            out[PENDING] = {"copy_wait_s": self._wait_events, "copy_s": self._copy_events,
                            "gather_s": self._gather_events}
            self._wait_events, self._copy_events, self._gather_events = [], [], []
        return out if deferred else resolved(out)


PENDING = "_pending_events"  # a counters dict's device timings not read yet: {field: [(start, end) events]}


def resolved(counters: dict) -> dict:
    """`counters` with the device timings it defers added to their fields (each waits for its last event)."""
    pending = counters.get(PENDING)
    if not pending:
        return counters
    out = {k: v for k, v in counters.items() if k != PENDING}
    for name, events in pending.items():
        if events:
            events[-1][1].synchronize()
            out[name] = out.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in events) / 1e3
    return out
