"""What matrix cells hold between one another, and what they let go: the NF4 store of the model in hand, built
once for all its cells (`StoreCache`, host memory); the device memory a cell leaves cached
(`free_device_memory`) and what earlier cells left allocated as the next one starts (`held_before`); and a failure kept for every cell that needs it, without the frames (and device
tensors) its tracebacks hold (`kept_failure`)."""

from __future__ import annotations

import contextlib
import gc
import traceback

import torch

from poros.harness.console import phase, progress
from poros.store.build import build_store


class StoreCache:
    """Keeps the most recently built NF4 store (host memory) so a model is built once (per `double_quant`)."""

    def __init__(self, device: str):
        self.device, self.key, self.store, self.stats = device, None, None, None

    def get(self, model: str, double_quant: bool = False):
        if self.key != (model, double_quant):

            self.store = self.stats = None
            gc.collect()
            with phase("store build"):
                self.store, self.stats = build_store(model, device=self.device, progress=None, double_quant=double_quant)
            self.key = (model, double_quant)
        return self.store

    def release(self) -> None:
        """Give the kept store's host memory back (a child process that needs the host's memory, Unsloth's
        offloaded activations at long context, runs next); the next `get` builds it again."""
        if self.store is not None:
            self.store.release()
        self.key = self.store = self.stats = None
        gc.collect()


def free_device_memory() -> None:
    """Between cells, once the last one's trainers are gone: their tensors collected, cuBLAS's workspaces dropped
    and the allocator's cache given back. cuBLAS keeps a workspace (CUBLAS_WORKSPACE_CONFIG's, 32 MiB at :4096:8)
    per stream that ever ran a matmul, from torch's allocator, for the life of the process: every trainer's new
    copy and backward streams left two more, and a matrix's later cells started with them allocated beside their
    plan. Only where no CUDA graph of an earlier cell lives: a graph captured over a workspace writes into it
    on every replay."""
    gc.collect()
    if torch.cuda.is_available():
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU builds
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


HELD_NOTED_GB = 0.05  # less than this left allocated by earlier cells goes unremarked (the store's stray scalars)


def held_before(device: str) -> float | None:
    """A cell's start on `device`: the peaks reset, and the GB of device memory this process's allocator still holds
    from earlier cells (None off CUDA). Every peak the cell records includes them (a poros plan counts them in
    its budget and prediction: DeviceMemory.allocated), so more than HELD_NOTED_GB is said on the console."""
    if device != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() / 1e9
    if held >= HELD_NOTED_GB:
        progress(f"  {held:.2f} GB of device memory is still allocated from earlier cells: what follows holds it "
                 "beside its plan (its peaks include it)")
    return held


def kept_failure(error: BaseException) -> BaseException:
    """`error`, to be kept after its handler ends (a gate's outcome, raised again for every cell that needs
    it), with the locals of every frame of its tracebacks cleared, its causes' and contexts' too: those
    frames hold the trainer that failed, and with it every tensor it had on the device, for as long as the
    error is kept."""
    seen = set()
    e = error
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__cause__, e.__context__]
    return error


@contextlib.contextmanager
def frames_released():
    """Work whose failure (raised on) keeps none of its frames' locals: pytest keeps the last failure's traceback
    for post-mortem debugging, and a trainer's set-up or step that ran out of memory has views of its device
    buffers among them, which every later cell of the process would then find allocated beside its plan."""
    try:
        yield
    except BaseException as e:
        kept_failure(e)
        raise
