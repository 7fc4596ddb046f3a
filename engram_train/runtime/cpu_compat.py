"""Let megatron-core run on a host without CUDA: the bodies of the CPU patches.

megatron-core assumes CUDA in a few fixed places (see docs/cpu.md): it asks for
``torch.cuda.current_device()``, keeps its RNG tracker in CUDA generator state, creates
streams/events, builds a few tensors with ``device="cuda"``, and checks
``param.type() == "torch.cuda.FloatTensor"`` in the optimizer and grad clipping.

The patch registry (``runtime/patches.py``: ``cpu_cuda_redirects``, ``cpu_rng_tracker``)
applies these redirects process-wide, and only when ``torch.cuda.is_available()`` is False;
on a CUDA host nothing here runs, so the same code takes NCCL/CUDA/TE unchanged. Every
attribute is set through the registry's context, which records the original so that
``uninstall_cpu_compat()`` (tests) can restore it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable

import torch

# Tensor.type() names that megatron compares against; a CPU tensor reports its CUDA twin.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spec to the CPU; leave everything else alone."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _device_to_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # no pinned allocator without CUDA (megatron's CP RoPE)
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


class _NoOpStream:
    """Stands in for torch.cuda.Stream/Event: on one CPU stream every op is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _tensor_type(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    return type_


def redirect_cuda_to_cpu(ctx) -> None:
    """Patch ``cpu_cuda_redirects``: torch's CUDA entry points and device arguments -> CPU."""
    cuda = torch.cuda
    ctx.set(cuda, "current_device", lambda: "cpu")
    ctx.set(cuda, "set_device", lambda *a, **k: None)
    ctx.set(cuda, "device_count", lambda: 0)
    ctx.set(cuda, "synchronize", lambda *a, **k: None)
    ctx.set(cuda, "empty_cache", lambda *a, **k: None)
    ctx.set(cuda, "Stream", _NoOpStream)
    ctx.set(cuda, "Event", _NoOpStream)
    ctx.set(cuda, "current_stream", lambda *a, **k: _NoOpStream())
    ctx.set(cuda, "default_stream", lambda *a, **k: _NoOpStream())
    ctx.set(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    ctx.set(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    ctx.set(cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    ctx.set(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    ctx.set(cuda, "manual_seed_all", lambda seed: None)
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        ctx.set(cuda, stat, lambda *a, **k: 0)

    for factory in ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint",
                    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"):
        ctx.set(torch, factory, _device_to_cpu(getattr(torch, factory)))

    ctx.set(torch.Tensor, "cuda", lambda self, *a, **k: self)
    ctx.set(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    ctx.set(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and (isinstance(args[0], (str, torch.device)) or isinstance(args[0], int)):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    ctx.set(torch.Tensor, "to", to)


def rng_tracker_on_cpu(ctx) -> None:
    """Patch ``cpu_rng_tracker``: megatron's RNG tracker stores and restores CUDA generator
    state directly (``tensor_parallel/random.py``); give it the CPU generator's."""
    from megatron.core.tensor_parallel import random as mp_random

    ctx.set(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    ctx.set(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))


# ----------------------------------------------------------------- checkpoint writer's queue

_FORKED_RESULTS_QUEUE = None


def _forked_write_results_queue(mp_mode: str = "fork") -> Any:
    """The queue megatron's checkpoint writer collects its write results on, served by a
    manager started with ``fork``. megatron-core starts it with ``spawn``: a fresh interpreter
    that imports the training script's main module again (torch and megatron-core, about 2 s
    of CPU per saving rank at its first save). The writer's own workers are forked already
    (``write_preloaded_data_multiproc``), so a forked manager adds no new kind of process.
    ``mp_mode`` is megatron-core 0.19's argument; any value gets the forked manager."""
    global _FORKED_RESULTS_QUEUE
    if _FORKED_RESULTS_QUEUE is None:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(_manager_started, (os.getpid(),))
        _FORKED_RESULTS_QUEUE = manager.Queue()
    return _FORKED_RESULTS_QUEUE


def _manager_started(parent: int) -> None:
    """First thing in the forked manager: leave the rank's process group, and end with the
    rank. torchrun stops a rank with ``killpg(SIGTERM)``; the rank's own SIGTERM handler then
    saves a last checkpoint, which needs this manager alive: in the rank's group it would be
    gone before that save (its SIGTERM is the default one)."""
    os.setpgid(0, 0)
    end_with_parent(parent)


def start_writer_queue_early() -> bool:
    """Fork the checkpoint writer's queue manager now, while this process is small, when
    `cpu_forked_checkpoint_queue` is active (else nothing: megatron's own manager is spawned,
    a fresh interpreter that shares no pages). Call it before building a model that will be
    saved. A manager forked at the first save shares every page of the model's tables with
    the trainer, and each page the trainer writes afterwards (an update, a resume's load) is
    copied into memory outside the trainer's RSS: up to the tables' size again, which a
    host-resident table sized to the machine does not survive. Returns whether it started."""
    module, name = _write_results_queue_getter()
    if getattr(module, name) is not _forked_write_results_queue:
        return False
    _forked_write_results_queue()
    return True


def end_with_parent(parent: int) -> None:
    """In a forked helper process (here: the manager): end when the process that started it
    (pid `parent`) ends, even if that one ends without its exit handlers (``os._exit``). A fork holds every file its parent had open
    (a spawned manager would not): an orphaned one would keep pipes of its parent's parent
    open, and their readers would wait for an end of file that never comes. Linux only
    (``PR_SET_PDEATHSIG``); elsewhere the parent's exit handlers stop it as before."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(0)


def _write_results_queue_getter() -> tuple[Any, str]:
    """megatron's module and the name of its checkpoint writer's queue getter (0.16:
    ``_get_write_results_queue``, 0.19: ``get_write_results_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in ("_get_write_results_queue", "get_write_results_queue"):
        if hasattr(filesystem_async, name):
            return filesystem_async, name
    raise RuntimeError("megatron-core's filesystem_async has no write-results queue getter")


def writer_queue_forked(ctx: Any) -> None:
    """Patch body: the writer's queue getter replaced by `_forked_write_results_queue`."""
    ctx.set(*_write_results_queue_getter(), _forked_write_results_queue)


def jit_fuser_eager(ctx: Any) -> None:
    """Patch body: megatron's JIT-fused functions run as written on the CPU.

    ``megatron.core.jit.jit_fuser`` is ``torch.compile``. On a CUDA device that fuses small
    elementwise kernels; on the CPU the first call of each decorated function makes TorchDynamo
    trace it and Inductor generate, compile and load C++ for it, in every rank process, and the
    guards on ``self`` make a method such as ``TopKRouter._apply_expert_bias`` compile again for
    each MoE layer: about 1.5 s of CPU and 20 MiB of RSS per rank at start-up, for no speed at
    these sizes, and the same results (the fused functions are elementwise ones and sums).
    Functions decorated when megatron's modules were imported are wrapped already, so
    TorchDynamo is switched off for the process (``torch._dynamo.config.disable``: compiled
    callables run their original code); functions megatron decorates later (the experts'
    activation closures) get the no-op decorator."""
    import torch._dynamo
    from megatron.core import jit

    ctx.set(torch._dynamo.config, "disable", True)
    ctx.set(jit, "jit_fuser", jit.noop_decorator)
