"""The device side of a plan: its weight buffers with the copies into them and the events that order
them (`DeviceBuffers`), and each layer's saved input, kept for its recompute (`SavedInputs`).

Copies run on their own stream. Each buffer has a `ready` event (recorded after a load) that the
compute stream waits for on its first read, and a `free` event (recorded at a release) that the next
load into it waits for: every ordering comes from the plan, whose rules `plan.check` verifies.

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
from poros.engine.distributed import SINGLE, World

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
        pad = plan.head_pad
        lead = pad if plan.head_buffer == 0 else 0
        self.region = torch.empty(lead + len(stream) * size + (pad - lead), dtype=torch.uint8, device=device)
        self.views: dict[int, torch.Tensor] = {b.index: self.region[lead + b.index * size: lead + (b.index + 1) * size]
                                               for b in stream}
        for b in plan.buffers:
            if b.resident:
                self.views[b.index] = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
        self.head_host = head_host
        nbytes = head_host.numel() * head_host.element_size()
        if plan.head_buffer is not None:
            o = 0 if plan.head_buffer == 0 else size
            self.head_region = self.region[o: o + plan.gathered_size(nbytes)]  # the shares' padding included
        else:
            self.head_region = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.head = self.head_region[:nbytes].view(head_host.dtype).view(head_host.shape)
        self.ready, self.free = {}, {}
        self.fresh: set[int] = set()  # buffers loaded since the compute stream last waited for them
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.gather_stream = torch.cuda.Stream(device) if plan.shards > 1 else None
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

    def counters(self) -> dict:
        if self.cuda and (self._wait_events or self._copy_events):
            torch.cuda.synchronize(self.device)
            self.copy_wait_s += sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3
            self.copy_s += sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3
            self._wait_events, self._copy_events = [], []
        if self.cuda and self._gather_events:
            torch.cuda.synchronize(self.device)
            self.gather_s += sum(a.elapsed_time(b) for a, b in self._gather_events) / 1e3
            self._gather_events = []
        out = {"bytes_h2d": self.bytes_h2d, "block_copies": self.loads, "copy_s": self.copy_s,
               "copy_wait_s": self.copy_wait_s}
        if self.plan.shards > 1:
            out.update(bytes_gathered=self.bytes_gathered, gather_s=self.gather_s)
        return out



def _empty_like(t: torch.Tensor, device, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialized tensor like `t` on `device`, in `t`'s layout where that covers its elements densely
    without overlap (attention's output is a transposed view), else contiguous: torch's preserve_format."""
    return torch.empty_like(t, device=device, pin_memory=pin_memory)


class SavedInputs:
    """What each layer's recompute needs, one tuple of tensors per (layer, micro-batch): its input, and with
    `keep_attention` its attention's output and log-sum-exp (poros/engine/kept_attention.py). On the device, or
    (plan.offload_inputs) copied to pinned host memory in forward on a device->host stream, and brought back
    on a host->device stream of their own, a window of backward operations ahead, into fresh device memory.
    The bytes are the same either way.

    The way back has its own stream, not the weights' copy stream: a copy back waits for the compute stream to
    reach the point where its memory was allocated (`prefetch`), and on the weights' stream that wait would hold
    back every weight copy enqueued after it."""

    def __init__(self, plan: P.Plan, device: torch.device):
        self.offload, self.device = plan.offload_inputs, device
        self.cuda = device.type == "cuda"
        self.d2h = torch.cuda.Stream(device) if self.cuda and self.offload else None
        self.h2d = torch.cuda.Stream(device) if self.cuda and self.offload else None
        self.window = plan.input_window
        self.kept: dict = {}  # key -> device tensors
        self.host: dict = {}  # key -> (host tensors, event after their device->host copy)
        self.ready: dict = {}  # key -> (event after the host->device copy, host tensors, stream that allocated them)
        self._pool: dict[tuple, list] = {}  # `_kind` of the tensors -> host tensors, reused step after step
        self.bytes_d2h = self.bytes_h2d = 0

    @staticmethod
    def _kind(tensors) -> tuple:
        """Shape, dtype and the strides a copy of each tensor gets (`_empty_like`, on the meta device: no memory)."""
        return tuple((tuple(t.shape), _empty_like(t, "meta").stride(), t.dtype) for t in tensors)

    def put(self, key, *tensors: torch.Tensor) -> None:
        if not self.offload:
            self.kept[key] = tensors
            return
        pool = self._pool.get(self._kind(tensors))
        host = pool.pop() if pool else tuple(_empty_like(t, "cpu", pin_memory=self.cuda) for t in tensors)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                for h, t in zip(host, tensors):
                    h.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.d2h)
            for t in tensors:
                t.record_stream(self.d2h)  # its memory is not reused before the copy ends
        else:
            for h, t in zip(host, tensors):
                h.copy_(t)
            done = None
        self.host[key] = (host, done)
        self.bytes_d2h += sum(t.numel() * t.element_size() for t in tensors)

    def _recycle(self, host) -> None:
        self._pool.setdefault(self._kind(host), []).append(host)

    def prefetch(self, key) -> None:
        if key in self.kept or key not in self.host:
            return
        host, done = self.host.pop(key)
        if self.cuda:
            # Allocated on the stream that reads and frees them, from the memory its own intermediates come
            # from: blocks allocated on the copy stream would be kept for that stream's later allocations
            # alone, a second reserve beside the compute stream's. A block may have served an earlier tensor
            # whose work that stream has not finished, so the copy waits for the stream to reach this point.
            stream = torch.cuda.current_stream(self.device)
            dev = tuple(_empty_like(h, self.device) for h in host)
            allocated = torch.cuda.Event()
            allocated.record(stream)
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(done)
                self.h2d.wait_event(allocated)
                for d, h in zip(dev, host):
                    d.copy_(h, non_blocking=True)
                    d.record_stream(self.h2d)  # dropped before it is read (a closing trainer): not reused mid-copy
                ready = torch.cuda.Event()
                ready.record(self.h2d)
            self.ready[key] = (ready, host, stream)
        else:
            dev = tuple(_empty_like(h, self.device).copy_(h) for h in host)
            self._recycle(host)
        self.kept[key] = dev
        self.bytes_h2d += sum(d.numel() * d.element_size() for d in dev)

    def take(self, key) -> tuple[torch.Tensor, ...]:
        """The tensors `put` under `key`, given up."""
        self.prefetch(key)
        tensors = self.kept.pop(key)
        if key in self.ready:
            ready, host, allocated_on = self.ready.pop(key)
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            if stream != allocated_on:
                for t in tensors:
                    t.record_stream(stream)  # read on another stream than the one they were allocated on
            self._recycle(host)  # reusable once the copy is done: the next put follows this wait
        return tensors

    def peek(self, key) -> tuple[torch.Tensor, ...]:
        """The tensors without giving them up (a template that may decline still needs them)."""
        tensors = self.take(key)
        self.kept[key] = tensors
        return tensors

    def __len__(self) -> int:
        return len(self.kept) + len(self.host)

    def clear(self) -> None:
        self.kept.clear()
        self.host.clear()
        self.ready.clear()
        self._pool.clear()
