"""What each recomputed layer's recompute needs from its forward, one tuple of tensors per (layer,
micro-batch): its input, and with `keep_attention` its attention's output and log-sum-exp
(poros/engine/model/kept_attention.py). `SavedInputs` keeps them on the device, or, for the layers a plan places in
host memory (`Plan.host_inputs`), moves them as the plan's operations say: `offload` copies one device->host
into its slot of the host arena on a stream of its own, right after its forward, and `fetch` brings it back
into fresh device memory ahead of its backward, on the stream that copies the weights in. The bytes are the same
either way.

The arena (`HostArena`) has the plan's exact size (`Plan.host_input_bytes`): allocated once and page-locked in
place, as the NF4 store is, because torch's caching host allocator rounds every pinned block up to a power of
two (up to twice the bytes at sequence lengths where one input is not a power of two).

The way back shares the weights' copy stream (`h2d`), so the link takes the two kinds of copy in the plan's order,
as the plan's timeline counts them (poros/engine/planning/timeline.py: its schedule floor is this order's). A copy
back waits for the compute stream to reach the point where its memory was allocated, the end of the backward
before its fetch, and a load the plan puts after it waits for that point too. Mostly that is where the load's
buffer is released anyway; in some spread plans a load comes after a fetch that is a backward or more later than
its release, and the timeline counts that wait. On a stream of its own, a copy back that became ready together
with a weight copy enqueued after it could run after it: the backward then waited a whole layer's load for its
input, and the link idled while that backward ran, both buffers full (experiments/h100-streamed-link-idle).
"""

from __future__ import annotations

import math

import torch

from poros.engine.parallel.distributed import World, largest
from poros.engine.planning import plan as P
from poros.engine.planning.inputs import HostMemory
from poros.errors import CapabilityError, PinningError
from poros.store.arena import memlock_limit, pin_in_place
from poros.store.host_memory import available_host_memory
from poros.store.layout import align
from poros.sizes import is_auto


class HostArena:
    """The host slots of a plan's saved inputs: one byte tensor of exactly `slots` x `slot_bytes`, page-locked
    in place with `pin` (cudaHostRegister)."""

    def __init__(self, slots: int, slot_bytes: int, pin: bool):
        self.slot_bytes = slot_bytes
        self.bytes = torch.empty(slots * slot_bytes, dtype=torch.uint8)
        self.pinned = False
        if pin and self.bytes.numel():
            if not pin_in_place(self.bytes):
                raise PinningError(f"pinning {self.bytes.numel() / 1e9:.1f} GB for the saved inputs in host memory "
                                   f"failed (cudaHostRegister): the locked-memory limit is {memlock_limit()} (ulimit -l); "
                                   "raise it, keep more inputs on the device (--device-inputs), or pass --no-pin")
            self.pinned = True

    def views(self, slot: int, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Tensors shaped and laid out as `like` (torch's preserve_format), back to back in slot `slot`, each
        aligned as the planner sized the slot (poros/engine/planning/inputs.py `slot_bytes`).

        Raises:
            CapabilityError: the tensors need more than the slot (the plan sized it for other shapes).
        """
        base, offset, out = slot * self.slot_bytes, 0, []
        for t in like:
            n = t.numel() * t.element_size()
            if offset + n > self.slot_bytes:
                raise CapabilityError(f"a saved input of {sum(x.numel() * x.element_size() for x in like)} bytes does "
                                      f"not fit its host slot of {self.slot_bytes}: the plan was made for other shapes")
            view = self.bytes[base + offset: base + offset + n].view(t.dtype)
            # torch's preserve_format: `t`'s layout where it covers its elements densely (attention's output is
            # a transposed view), else contiguous
            out.append(view.as_strided(t.shape, torch.empty_like(t, device="meta").stride()))
            offset = align(offset + n)
        return tuple(out)

    def release(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False

    def __del__(self):  # the memory must not be freed while still registered with the driver
        try:
            self.release()
        except Exception:
            pass


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SavedInputs:
    """The saved inputs of a plan's step (module docstring); `pin`: page-lock the host arena on CUDA; `h2d`: the
    stream that copies the weights in (DeviceBuffers.copy_stream; None off CUDA), which the copies back share."""

    def __init__(self, plan: P.Plan, device: torch.device, h2d: torch.cuda.Stream | None, pin: bool = True):
        self.device = device
        self.cuda = device.type == "cuda"
        moves = bool(plan.host_inputs)
        self.d2h = torch.cuda.Stream(device) if self.cuda and moves else None
        self.h2d = h2d if moves else None
        self.arena = HostArena(plan.host_slots, plan.input_slot, pin and self.cuda) if moves else None
        self.kept: dict = {}  # key -> device tensors
        self.host: dict = {}  # key -> (its slot's tensors, event after their device->host copy)
        self.ready: dict = {}  # key -> (event after its host->device copy, stream that allocated its tensors)
        self.emptied: dict[int, torch.cuda.Event] = {}  # slot -> event after the last copy out of it
        self.bytes_d2h = self.bytes_h2d = 0

    def put(self, key, *tensors: torch.Tensor) -> None:
        """What layer key[0]'s recompute for micro-batch key[1] needs, on the device until an offload moves it."""
        self.kept[key] = tensors

    def offload(self, key, slot: int) -> None:
        """Copy `key`'s tensors into host slot `slot` once the compute stream has made them (and the slot's last
        copy back is done); their device memory is reusable after the copy."""
        tensors = self.kept.pop(key)
        host = self.arena.views(slot, tensors)
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h):
                if slot in self.emptied:
                    self.d2h.wait_event(self.emptied[slot])
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
        self.host[key] = (slot, host, done)
        self.bytes_d2h += _nbytes(tensors)

    def fetch(self, key) -> None:
        """Bring `key`'s tensors back from host memory into fresh device memory (the copy starts once the
        compute stream reaches this point); `take` waits for it."""
        slot, host, done = self.host.pop(key)
        if self.cuda:
            # Allocated on the stream that reads and frees them, from the memory its own intermediates come
            # from: blocks allocated on the copy stream would be kept for that stream's later allocations
            # alone, a second reserve beside the compute stream's. A block may have served an earlier tensor
            # whose work that stream has not finished, so the copy waits for the stream to reach this point.
            stream = torch.cuda.current_stream(self.device)
            dev = tuple(torch.empty_like(h, device=self.device) for h in host)
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
            self.ready[key] = (ready, stream)
            self.emptied[slot] = ready
        else:
            dev = tuple(torch.empty_like(h, device=self.device).copy_(h) for h in host)
        self.kept[key] = dev
        self.bytes_h2d += _nbytes(dev)

    def take(self, key) -> tuple[torch.Tensor, ...]:
        """The tensors `put` under `key`, given up (fetched back where they were offloaded).

        Raises:
            AssertionError: they are still in host memory: the plan fetches them nowhere before their backward
                (a plan the rules refuse).
        """
        if key in self.host:
            raise AssertionError(f"the saved input of layer {key[0]}, micro-batch {key[1]} is in host memory: the "
                                 "plan fetches it nowhere before its backward")
        tensors = self.kept.pop(key)
        if key in self.ready:
            ready, allocated_on = self.ready.pop(key)
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            if stream != allocated_on:
                for t in tensors:
                    t.record_stream(stream)  # read on another stream than the one they were allocated on
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
        self.emptied.clear()
        if self.arena is not None:
            self.arena.release()


def host_memory(cfg, world: World, store_bytes: int) -> HostMemory | None:
    """This host's memory as `host_budget: auto` plans with it (None: unmeasured), once the store (`store_bytes`)
    is built: what the host has left, and the store. Data-parallel ranks share their host's memory and one store
    (poros.engine.parallel.distributed `share_store`): each plans for its share (of its host's ranks) of the least any
    rank found, so that every rank makes the same plan."""
    if not is_auto(cfg.host_budget) or cfg.device.value != "cuda":
        return None
    available = available_host_memory()
    if world.distributed:
        least = -largest(-(math.inf if available is None else float(available)), world)
        available = None if math.isinf(least) else int(least) // world.local_size
    return None if available is None else HostMemory(available, held=store_bytes)
