"""Let megatron-core 0.16.1 run on a host without CUDA.

megatron-core assumes CUDA in a few fixed places (see docs/cpu.md): it asks for
``torch.cuda.current_device()``, keeps its RNG tracker in CUDA generator state, creates
streams/events, builds a few tensors with ``device="cuda"``, and checks
``param.type() == "torch.cuda.FloatTensor"`` in the optimizer and grad clipping.

``install_cpu_compat()`` redirects exactly those to the CPU, process-wide, and only when
``torch.cuda.is_available()`` is False. On a CUDA host it does nothing and returns False,
so the same code takes NCCL/CUDA/TE unchanged. Every redirect is listed in ``_REDIRECTS``
so ``uninstall_cpu_compat()`` (used by tests) can restore the originals.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

_REDIRECTS: list[tuple[Any, str, Any]] = []  # (owner, attribute, original)
_INSTALLED = False

# Tensor.type() names that megatron compares against; a CPU tensor reports its CUDA twin.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def is_installed() -> bool:
    return _INSTALLED


def _redirect(owner: Any, name: str, replacement: Any) -> None:
    _REDIRECTS.append((owner, name, getattr(owner, name, None)))
    setattr(owner, name, replacement)


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


def install_cpu_compat() -> bool:
    """Install the CPU redirects if CUDA is absent. Returns True when installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False

    cuda = torch.cuda
    _redirect(cuda, "current_device", lambda: "cpu")
    _redirect(cuda, "set_device", lambda *a, **k: None)
    _redirect(cuda, "device_count", lambda: 0)
    _redirect(cuda, "synchronize", lambda *a, **k: None)
    _redirect(cuda, "empty_cache", lambda *a, **k: None)
    _redirect(cuda, "Stream", _NoOpStream)
    _redirect(cuda, "Event", _NoOpStream)
    _redirect(cuda, "current_stream", lambda *a, **k: _NoOpStream())
    _redirect(cuda, "default_stream", lambda *a, **k: _NoOpStream())
    _redirect(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    _redirect(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _redirect(cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    _redirect(cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    _redirect(cuda, "manual_seed_all", lambda seed: None)
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        _redirect(cuda, stat, lambda *a, **k: 0)

    for factory in ("tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint",
                    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor"):
        _redirect(torch, factory, _device_to_cpu(getattr(torch, factory)))

    _redirect(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _redirect(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    _redirect(torch.Tensor, "type", _tensor_type(torch.Tensor.type))
    original_to = torch.Tensor.to

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and (isinstance(args[0], (str, torch.device)) or isinstance(args[0], int)):
            args = (_cpu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original_to(self, *args, **kwargs)

    _redirect(torch.Tensor, "to", to)

    # megatron's RNG tracker stores and restores CUDA generator state directly.
    from megatron.core.tensor_parallel import random as mp_random

    _redirect(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    _redirect(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))

    _INSTALLED = True
    return True


def uninstall_cpu_compat() -> None:
    """Restore every redirected attribute (tests)."""
    global _INSTALLED
    while _REDIRECTS:
        owner, name, original = _REDIRECTS.pop()
        setattr(owner, name, original)
    _INSTALLED = False
