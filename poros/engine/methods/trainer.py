"""The training-step API every method implements; resident QLoRA is the reference method."""

from __future__ import annotations

import abc
import contextlib
import functools
import gc
import os
import re
import time
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from poros.choices import Device
from poros.config import Method, TrainConfig
from poros.engine.model.attention import BackendLog, sdpa_context
from poros.engine.runtime.buffers import resolved
from poros.engine.model.compiling import (compile_layers, enable_deterministic_compile, install_layer_compilation,
                                    keep_mlp_eager)
from poros.engine.methods.data import Batch, synthetic_step
from poros.engine.parallel.distributed import SINGLE, World, rank_ordered_mean, reduce_mean
from poros.engine.runtime.host_saved import HostSaved, saved_host_limit
from poros.engine.planning.plan import Plan
from poros.engine.model.qlora import QLoRAModel
from poros.engine.methods.schedule import learning_rate
from poros.errors import CapabilityError
from poros.models.skeleton import check_seq_len
from poros.store.arena import NF4Store
from poros.store.host_memory import available_host_memory
from poros.sizes import is_auto

CUBLAS_WORKSPACE = ":4096:8"  # a fixed cuBLAS workspace: repeatable matmuls (strict mode refuses others)
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"  # PyTorch's refusal in strict mode


def set_cublas_workspace() -> None:
    """Set CUBLAS_WORKSPACE_CONFIG unless the environment already does.

    PyTorch and cuBLAS read it once, at the process's first cuBLAS work: call this before anything
    touches CUDA (the CLI does when a command asks for `deterministic`, the matrix suites at session
    start). Called later, it still sets the variable but warns that matmuls may not be repeatable.
    """
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn("deterministic mode enabled after CUDA was initialized: cuBLAS may already have chosen "
                      "its workspace, so matmuls may not be repeatable in this process; set "
                      f"CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting it", RuntimeWarning, stacklevel=2)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE


def enable_determinism() -> None:
    """Strict deterministic algorithms, process-wide, for every method alike.

    Strict (not `warn_only`): PyTorch then runs the deterministic variants of the flash and
    memory-efficient attention backward (without it they accumulate dQ with atomics, so their bits
    change with timing), leaves cuDNN attention out of SDPA's selection, and refuses an op that has no
    deterministic implementation instead of running it with a warning; `deterministic_kernels` turns
    that refusal into one line.

    Without filling uninitialized memory: in this mode PyTorch by default writes NaN into every tensor it
    allocates without initializing (`torch.empty`, a kernel's output), which costs a pass over memory per
    allocation (bitsandbytes' dequantized weights, attention's outputs) and changes no result of a program that
    reads only what it wrote. PyTorch's documentation of `torch.utils.deterministic.fill_uninitialized_memory`
    says such a program stays deterministic with it off; the parity gate compares every bit either way.
    """
    set_cublas_workspace()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def one_cpu_thread() -> None:
    """Torch's CPU kernels on one thread, process-wide, for every method alike. ATen splits an elementwise op among
    its OpenMP threads and MKL computes each part (the rotary table's cos, say); with more threads than free cores,
    the part a second thread computed has come out one ulp apart from one process to the next
    (results/cpu/README.md), in the reference itself, which a gate cannot tell from a difference of poros's own. On
    one thread every part is computed the same way every time."""
    torch.set_num_threads(1)


def kernel_refusal(error: BaseException) -> CapabilityError | None:
    """The one-line error for strict mode's refusal of a kernel (None for any other error)."""
    text = str(error)
    if NO_DETERMINISTIC_KERNEL in text:
        m = re.search(r"(\S+) " + NO_DETERMINISTIC_KERNEL, text)
        op = m.group(1) if m else "an operation"
        return CapabilityError(f"{op} has no deterministic implementation on this stack and `deterministic` asks "
                               "for one: drop deterministic (--deterministic, `deterministic: true`) or pick another "
                               "attention backend (--attention, `attention:`)")
    if "CUBLAS_WORKSPACE_CONFIG" in text:
        return CapabilityError("cuBLAS is not configured for repeatable matmuls and `deterministic` asks for them: "
                               f"set CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} in the environment before the process "
                               "starts, or drop deterministic")
    return None


@contextlib.contextmanager
def deterministic_kernels():
    """Training work under strict mode: a kernel it refuses ends in one CapabilityError naming the op
    (not a traceback, and not a silent fallback to the nondeterministic kernel)."""
    try:
        yield
    except RuntimeError as e:
        refusal = kernel_refusal(e)
        if refusal is None:
            raise
        raise refusal from None


_after_step = None  # called after every optimizer step of every trainer in this process (`after_each_step`)


@contextlib.contextmanager
def after_each_step(hook):
    """While inside, `hook()` runs after every optimizer step of every trainer in this process (a harness's time
    budget: poros/harness/budget.py; it may raise to stop the run between steps)."""
    global _after_step
    previous, _after_step = _after_step, hook
    try:
        yield
    finally:
        _after_step = previous


class StepResult:
    """One optimizer step's outcome. `loss`: the sum over micro-batches of the scaled loss, i.e. the mean loss of the
    step (over every rank's); `seconds`: what the step took the host to enqueue; `counters`: what it copied and
    when. The loss and the copy timings stay on the device until first read, so a loop that reads them now and
    then enqueues its next step while the device still runs this one (no synchronization a step)."""

    def __init__(self, loss, seconds: float, counters: dict | None = None):
        self._loss, self.seconds, self._counters = loss, seconds, counters if counters is not None else {}

    @property
    def loss(self) -> float:
        if not isinstance(self._loss, float):
            self._loss = float(self._loss)  # waits for the step's last kernel that the loss depends on
        return self._loss

    @property
    def counters(self) -> dict:
        self._counters = resolved(self._counters)
        return self._counters


class Trainer(abc.ABC):
    """A QLoRA training loop: `accumulate` the micro-batches of a step, then `optimizer_step`.

    Subclasses change how the base weights reach the device, never the arithmetic: each makes its model
    (`_make_model`), runs a step's micro-batches (`accumulate`) and spreads them over ranks (`_distribute`).
    """

    method: str  # its Method's value (poros/config.py)
    plan: Plan | None = None  # how the decoder weights reach the device (poros/engine/planning/plan.py); None: all resident

    def __init__(self, store: NF4Store, cfg: TrainConfig, world: World = SINGLE):
        check_seq_len(store.config, cfg.seq_len)
        if cfg.device is Device.CPU:
            one_cpu_thread()
        if cfg.deterministic:
            enable_determinism()
            if cfg.compile:
                enable_deterministic_compile()
        self.store, self.cfg, self.world = store, cfg, world
        self.device = torch.device(cfg.device.value)
        self.ddp = None  # resident under DistributedDataParallel (`_distribute`)
        self.reducer = None  # or poros's own per-layer reduction (its `_distribute`)
        self.attention_backends: dict[str, str] | None = None  # attention shape -> SDPA backend, once recorded
        self.qlora = self._make_model()
        self.model = self.qlora.add_lora()
        self.params = self.qlora.lora_parameters()
        # fused: one kernel, no foreach temporaries the size of the AdamW state (HF Trainer's
        # default, adamw_torch_fused); the same optimizer for every method, so parity holds
        self.optimizer = torch.optim.AdamW([p for _, p in self.params], lr=learning_rate(cfg, 0),
                                           weight_decay=cfg.weight_decay, fused=True)
        self.steps_done = 0
        if world.distributed:
            self._distribute()

    @abc.abstractmethod
    def _make_model(self) -> QLoRAModel:
        """The QLoRA model this trainer trains, its base weights where the method keeps them."""

    @abc.abstractmethod
    def _distribute(self) -> None:
        """Set up data parallelism over `self.world` (called when it has several ranks)."""

    @abc.abstractmethod
    def accumulate(self, batches: list[Batch]) -> list[torch.Tensor]:
        """The scaled loss of every micro-batch of one step, LoRA gradients accumulated into their `.grad`s
        as resident QLoRA accumulates them."""

    def batches(self, step: int) -> list[Batch]:
        c = self.cfg
        vocab = self.store.config.vocab_size
        w = self.world  # every rank draws the step's world.size * grad_accum micro-batches and takes its share
        step_batches = synthetic_step(vocab, c.seq_len, c.batch_size, c.grad_accum * w.size, seed=c.data_seed,
                                      step=step)
        return [b.to(self.device) for b in w.share(step_batches)]

    def accumulate_step(self, batches: list[Batch]) -> list[torch.Tensor]:
        """`accumulate`, recording on the first call which SDPA backend each attention shape runs on
        (`attention_backends`; with CUDA-graph layers the first call is the one that still runs Python).
        Compiled layers are not recorded: the recorder, a Python function in place of SDPA, would split each
        layer's compiled graph at its attention call on that step (and compile it again after)."""
        self.qlora.dropout_keys.step = self.steps_done
        if self.attention_backends is not None or self.cfg.compile:
            return self.accumulate(batches)
        with BackendLog() as log:
            losses = self.accumulate(batches)
        self.attention_backends = log.seen
        return losses

    def dropout_micro(self, k: int, per_rank: int) -> None:
        """The LoRA dropout masks drawn from now on are micro-batch `k`'s of this rank's `per_rank`
        (keyed by its index among every rank's: the masks of a data-parallel run are a single run's)."""
        self.qlora.dropout_keys.micro = self.world.rank * per_rank + k

    def clip_gradients(self) -> torch.Tensor | None:
        """Scale the LoRA gradients to at most `max_grad_norm` in global L2 norm (torch's
        clip_grad_norm_ arithmetic, one tensor at a time in parameter order: the same bits for every
        method). The scaled gradients are new tensors: the accumulated ones, which the gate compares,
        stay as they were. Returns the norm before clipping (None without max_grad_norm)."""
        if self.cfg.max_grad_norm is None:
            return None
        grads = [p.grad for _, p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        scale = torch.clamp(self.cfg.max_grad_norm / (norm + 1e-6), max=1.0)
        for _, p in self.params:
            if p.grad is not None:
                p.grad = p.grad * scale.to(p.grad.device)
        return norm

    def optimizer_step(self) -> None:
        """Clip, set the step's learning rate (poros/engine/methods/schedule.py), update, drop the gradients.
        Under data parallelism the gradients are reduced over the ranks already (in `accumulate`)."""
        self.clip_gradients()
        lr = learning_rate(self.cfg, self.steps_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        if _after_step is not None:
            _after_step()

    def counters(self, deferred: bool = False) -> dict:
        """What the last step did beside its arithmetic (bytes copied, and when); `deferred`: its device timings
        left on the device, for `StepResult` to read when asked (`poros.engine.runtime.buffers.resolved`)."""
        return {}

    def leave_host_memory(self, nbytes: int) -> None:
        """Host memory something beside this trainer will take while it trains (the gate's states recorded
        from it): a trainer that sizes its own host memory by what the host has free leaves that much of it.
        This one sizes none."""

    def reset_to(self, lora: dict[str, torch.Tensor]) -> None:
        """Back to the start of training from the LoRA weights `lora` (e.g. `RecordedReference.init`):
        weights copied in, gradients and AdamW state dropped, the step count at 0. A trainer reset this way
        trains as a fresh one does (the sweep's control gates exactly that), without building it again."""
        with torch.no_grad():
            for name, p in self.params:
                p.copy_(lora[name])
                p.grad = None
        self.optimizer.state.clear()
        self.steps_done = 0

    @contextlib.contextmanager
    def alone(self):
        """This rank trains by itself while inside: `grad_accum` micro-batches of its own a step and no
        collective, on the set-up it already has (a data-parallel run's one-GPU figure, same process, same
        schedule, no second build). Its weights then differ from the other ranks': time with it last."""
        held = self.world, self.ddp, self.reducer
        self.world, self.ddp, self.reducer = SINGLE, None, None
        try:
            yield self
        finally:
            self.world, self.ddp, self.reducer = held

    def step(self, batches: list[Batch] | None = None) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches of the synthetic data."""
        batches = batches if batches is not None else self.batches(self.steps_done)
        t0 = time.perf_counter()
        loss = torch.zeros((), device=self.device)
        with deterministic_kernels():
            for micro in self.accumulate_step(batches):
                loss = loss + micro.float()
            self.optimizer_step()
        value = reduce_mean(float(loss), self.world, self.device) if self.world.distributed else loss
        return StepResult(value, time.perf_counter() - t0, self.counters(deferred=True))

    # --- state for the parity gate --------------------------------------------------------
    def lora_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params}

    def lora_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for n, p in self.params}

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                out[f"{n}:{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        return out

    def close(self) -> None:
        """Release device memory held by this trainer (now, not at the next gc cycle)."""
        self.optimizer.state.clear()
        for _, p in self.params:
            p.grad = None
        del self.model, self.qlora, self.params, self.optimizer, self.ddp
        if self.cfg.compile:  # dynamo's caches hold the compiled layers, and through them their weights
            torch._dynamo.reset()
        gc.collect()


class ResidentTrainer(Trainer):
    """Ordinary QLoRA: the whole NF4 model on the device."""

    method = Method.RESIDENT.value

    def _make_model(self) -> QLoRAModel:
        model = QLoRAModel(self.store, self.cfg, self.device)
        model.materialize_resident()
        if self.cfg.compile:
            self._compile(model)
        return model

    def _compile(self, model: QLoRAModel) -> None:
        compile_layers(model.layers, mlp=self.cfg.compile_mlp)

    def _distribute(self) -> None:
        """The model under DistributedDataParallel: LoRA gradients reduced in the last micro-batch's backward
        (the others run under `no_sync`), each bucket by `rank_ordered_mean`, poros's arithmetic (an all-reduce
        would add the ranks in an order that depends on the bucket: poros/engine/parallel/distributed.py says why).
        Frozen weights and buffers are left out of its bucketing and broadcasts: every rank builds them from the
        same store."""
        frozen = [n for n, p in self.model.named_parameters() if not p.requires_grad]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self.model, frozen + [n for n, _ in self.model.named_buffers()])
        ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.model, device_ids=ids)
        self.ddp.register_comm_hook(None, rank_ordered_mean)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Scaled loss of one micro-batch, gradients accumulated into the LoRA `.grad`s."""
        with sdpa_context(self.cfg.attention):
            out = (self.ddp or self.model)(input_ids=batch.input_ids, labels=batch.labels, use_cache=False)
            loss = out.loss / self.cfg.grad_accum
            loss.backward()
        return loss.detach()

    def accumulate(self, batches: list[Batch]) -> list[torch.Tensor]:
        """The scaled loss of every micro-batch of one step, gradients accumulated into the LoRA
        `.grad`s in micro-batch order (under DDP, reduced over the ranks in the last one's backward)."""
        losses = []
        for k, b in enumerate(batches):
            self.dropout_micro(k, len(batches))
            if self.ddp is None:
                losses.append(self.forward_backward(b))
                continue
            with self.ddp.no_sync() if k < len(batches) - 1 else contextlib.nullcontext():
                losses.append(self.forward_backward(b))
        return losses


class ResidentGCTrainer(ResidentTrainer):
    """Resident QLoRA with the Hugging Face model's gradient checkpointing, as users run long context:
    non-reentrant `torch.utils.checkpoint` around every decoder layer, so a layer keeps only its input
    and recomputes its activations in backward. The same kernels compute the same values in the same
    order as plain resident QLoRA, so its bits are resident's (tests/engine/test_resident_gc.py gates that)."""

    method = Method.RESIDENT_GC.value

    def _make_model(self) -> QLoRAModel:
        model = super()._make_model()
        if self.cfg.compile:
            return model  # checkpointed around the compiled layers instead (`_compile`)
        checkpointing = {"use_reentrant": False}
        hf = model.hf
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.24; the older name is deprecated
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        return model

    def _compile(self, model: QLoRAModel) -> None:
        """Each layer's call compiled and checkpointed from outside: the same non-reentrant checkpoint, whose
        forward and recompute run resident's compiled training graph. (The model's own checkpointing sits inside
        the layer's forward, so `layer.compile()` would trace it into the graph: torch.compile's activation
        checkpointing, other kernels and other bits than resident's compiled layers.)"""
        install_layer_compilation()
        if not self.cfg.compile_mlp:
            keep_mlp_eager(model.layers)
        for layer in model.layers:
            layer.forward = functools.partial(checkpoint, torch.compile(type(layer).forward.__get__(layer)),
                                              use_reentrant=False)


class ResidentGCOffloadTrainer(ResidentGCTrainer):
    """resident_gc with every checkpointed layer's input, and what the head saves, in host memory from its
    forward to its backward (poros/engine/runtime/host_saved.py, as torch.autograd.graph.save_on_cpu keeps them): the
    reference at lengths where resident_gc's saved inputs do not fit the device beside the model. The same
    kernels read the same bytes, so its bits are resident_gc's (tests/engine/test_resident_gc.py gates that).
    `host_budget` bounds its host memory as it bounds poros's (the store and the saved tensors together): the
    saved tensors past it stay on the device."""

    method = Method.RESIDENT_GC_OFFLOAD.value

    def _make_model(self) -> QLoRAModel:
        cuda = self.device.type == "cuda"
        available = available_host_memory() if cuda and is_auto(self.cfg.host_budget) else None
        limit = saved_host_limit(self.cfg.host_budget, self.store.host_bytes, cuda, available)
        self.host_saved = HostSaved(pin=cuda and self.cfg.pin_memory, host_limit=limit)
        return super()._make_model()

    def leave_host_memory(self, nbytes: int) -> None:
        """The saved tensors' host limit less `nbytes` (where the host budget sets one)."""
        if self.host_saved.host_limit is not None:
            self.host_saved.host_limit = max(0, self.host_saved.host_limit - nbytes)

    def forward_backward(self, batch: Batch) -> torch.Tensor:
        with self.host_saved.scope(self.model):
            return super().forward_backward(batch)

    def counters(self, deferred: bool = False) -> dict:
        return self.host_saved.counters()

    def close(self) -> None:
        """As every trainer, and the pinned blocks its saved inputs used go back to the system: PyTorch's caching
        host allocator keeps freed pinned blocks for reuse, and at long context they are tens of GB that the
        method gated next (poros, its NF4 store and its saved inputs pinned in place) needs."""
        super().close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch._C._host_emptyCache()  # CUDA builds of torch >= 2.5; private, and the only way to release them
