"""Block streaming: the plan of K-layer blocks over the NF4 arena and the two device buffers they
are copied into, on a dedicated copy stream ordered by CUDA events (used by poros/residency.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from poros.store import NF4Store, align

N_BUFFERS = 2


@dataclass(frozen=True)
class Block:
    index: int
    first: int  # first layer index
    stop: int  # one past the last layer index
    start: int  # byte range in the arena
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def plan_blocks(store: NF4Store, block_size: int) -> list[Block]:
    n = len(store.layers)
    out = []
    for b, first in enumerate(range(0, n, block_size)):
        stop = min(first + block_size, n)
        out.append(Block(b, first, stop, store.layers[first].start, store.layers[stop - 1].end))
    return out


HEAD = -1  # marks a buffer lent to the lm_head weight


class BlockStreamer:
    """Device block buffers filled from the host arena on a dedicated copy stream.

    The two buffers are views of one region. During the head (final norm, lm_head, loss) the
    buffer of block B-2 is idle, so the lm_head weight is copied into it, extended by a pad when
    the lm_head is larger than a block: the head costs max(0, lm_head - block) bytes of extra
    memory instead of a whole lm_head, for one more block copy per step (B-2 is reloaded during
    the backward of B-1).
    """

    def __init__(self, store: NF4Store, blocks: list[Block], device: torch.device, head_bytes: int = 0):
        self.store, self.blocks, self.device = store, blocks, device
        self.cuda = device.type == "cuda"
        size = align(max(b.nbytes for b in blocks))
        nbuf = min(N_BUFFERS, len(blocks))
        self.head_slot = (len(blocks) - 2) % nbuf if nbuf == N_BUFFERS and head_bytes else None
        pad = align(max(0, head_bytes - size)) if self.head_slot is not None else 0
        lead = pad if self.head_slot == 0 else 0
        self.region = torch.empty(lead + nbuf * size + (pad - lead), dtype=torch.uint8, device=device)
        self.buffers = [self.region[lead + i * size : lead + (i + 1) * size] for i in range(nbuf)]
        if self.head_slot is None:
            self.head_region = torch.empty(head_bytes, dtype=torch.uint8, device=device) if head_bytes else None
        else:
            o = 0 if self.head_slot == 0 else size
            self.head_region = self.region[o : o + head_bytes]
        self.holds: list[int | None] = [None] * nbuf  # block index each buffer holds (or is filling)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self.ready = [torch.cuda.Event() for _ in range(nbuf)]
            self.free = [torch.cuda.Event() for _ in range(nbuf)]
            self.free_recorded = [False] * nbuf
            self.head_ready, self.head_free = torch.cuda.Event(), torch.cuda.Event()
            self.head_free_recorded = False
        self.reset_counters()

    def slot(self, b: int) -> int:
        return b % len(self.buffers)

    def reset_counters(self) -> None:
        self.bytes_h2d = 0
        self.copies = 0
        self.peak_resident = 0
        self.copy_wait_s = 0.0
        self.copy_s = 0.0
        self._wait_events: list[tuple] = []
        self._copy_events: list[tuple] = []

    def _copy(self, s: int | None, dst: torch.Tensor, src: torch.Tensor, ready) -> None:
        """Copy host->device on the copy stream, after the last reader of the destination is done
        (buffer `s`'s free event; for the lm_head also the previous head's backward)."""
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if s is not None and self.free_recorded[s]:
                    self.copy_stream.wait_event(self.free[s])
                if ready is self.head_ready and self.head_free_recorded:
                    self.copy_stream.wait_event(self.head_free)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.copy_stream)
                dst.copy_(src, non_blocking=True)
                end.record(self.copy_stream)
                ready.record(self.copy_stream)
                self._copy_events.append((start, end))
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            self.copy_s += time.perf_counter() - t0
            self.copy_wait_s = self.copy_s  # synchronous: every copy is waited for
        self.bytes_h2d += src.numel() * src.element_size()

    def prefetch(self, b: int) -> None:
        """Start copying block b into its buffer unless it is already there."""
        if b < 0 or b >= len(self.blocks):
            return
        s = self.slot(b)
        if self.holds[s] == b:
            return
        blk = self.blocks[b]
        self.holds[s] = b
        self._copy(s, self.buffers[s][: blk.nbytes], self.store.arena[blk.start : blk.end],
                   self.ready[s] if self.cuda else None)
        self.copies += 1
        self.peak_resident = max(self.peak_resident, sum(h is not None and h >= 0 for h in self.holds))

    def load_head(self, host: torch.Tensor) -> torch.Tensor:
        """Copy the lm_head weight into its lent buffer; returns the device view."""
        nbytes = host.numel() * host.element_size()
        dst = self.head_region[:nbytes].view(host.dtype).view(host.shape)
        if self.head_slot is not None:
            self.holds[self.head_slot] = HEAD
        self._copy(self.head_slot, dst, host, self.head_ready if self.cuda else None)
        return dst

    def acquire_head(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.head_ready)

    def release_head(self) -> None:
        """The head's backward is enqueued: its buffer may be refilled after it."""
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            self.head_free.record(stream)
            self.head_free_recorded = True
            if self.head_slot is not None:
                self.free[self.head_slot].record(stream)
                self.free_recorded[self.head_slot] = True

    def acquire(self, b: int) -> None:
        """Make the compute stream wait until block b is in its buffer."""
        self.prefetch(b)
        if self.cuda:
            s = self.slot(b)
            stream = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(self.ready[s])
            after.record(stream)
            self._wait_events.append((before, after))

    def release(self, b: int) -> None:
        """Mark the end of work that reads block b's buffer (its refill waits for this)."""
        if self.cuda:
            s = self.slot(b)
            self.free[s].record(torch.cuda.current_stream(self.device))
            self.free_recorded[s] = True

    def invalidate(self) -> None:
        self.holds = [None] * len(self.buffers)

    def counters(self) -> dict:
        if self.cuda and (self._wait_events or self._copy_events):
            torch.cuda.synchronize(self.device)
            self.copy_wait_s += sum(a.elapsed_time(b) for a, b in self._wait_events) / 1e3
            self.copy_s += sum(a.elapsed_time(b) for a, b in self._copy_events) / 1e3
            self._wait_events, self._copy_events = [], []
        return {
            "bytes_h2d": self.bytes_h2d,
            "block_copies": self.copies,
            "peak_blocks_resident": self.peak_resident,
            "copy_s": self.copy_s,
            "copy_wait_s": self.copy_wait_s,
        }
