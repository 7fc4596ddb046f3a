"""The trainer's memory check at start-up (``system.memory_check``, docs/memory.md): the plan of
the run's own config against this machine's memory, before the model is built.

``engram-train`` calls `check_memory` on every rank after the config, the tokenizer and the
checkpoint were checked and before any process group exists. Each rank plans the same config
(the model built once on the meta device, as ``engram-plan`` does: about 0.3 s) for the world
and the ranks per node torchrun gives it, and compares:

- on the CPU, the peak RSS of a node's ranks (``LOCAL_WORLD_SIZE`` x the rank's planned peak)
  with the host's memory for them (`host_memory`): what the kernel can still give
  (``MemAvailable``, i.e. what other processes leave) plus what this node's ranks hold already
  (their process baseline is in the plan), capped by the host's total and a cgroup limit;
- on CUDA, also the planned device peak of a rank with its device's free memory plus the CUDA
  context the plan counts (`device_memory`).

The plan's verdict decides (``plan_report.Plan.verdict``): ``no`` (a prediction alone exceeds
the machine) is refused in one line naming both figures, the largest item and the fields that
change it, unless ``system.memory_check=warn``; ``tight`` (fits as planned, not with the plan's
measured error) is a warning; ``off`` skips the plan.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

from engram_train.errors import ConfigError

log = logging.getLogger("engram_train")

GIB = 1 << 30
FIX = "set system.memory_check=warn to start anyway"


class MemoryCheckError(ConfigError):
    """The plan of this run does not fit this machine (``system.memory_check=refuse``)."""


@dataclass(frozen=True)
class Machine:
    """What this node offers the run: ``host_memory`` for its ranks together, ``device_memory``
    for one rank on CUDA (None on the CPU); ``*_source`` say how each was found."""

    device: str  # "cpu" or "cuda"
    host_memory: int
    host_source: str
    device_memory: int | None = None
    device_source: str = ""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (MemTotal, MemAvailable, ...); psutil's where it is missing."""
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith("kB\n")}
    except OSError:
        import psutil

        vm = psutil.virtual_memory()
        return {"MemTotal": int(vm.total), "MemAvailable": int(vm.available)}


def _rss() -> int:
    """This process's resident bytes now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return int(psutil.Process().memory_info().rss)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_room(total: int) -> tuple[int, int] | None:
    """(limit, room) of this process's memory cgroup (v2, else v1) when it limits below the
    host's total: room is the limit less what the group holds beyond its reclaimable page cache."""
    for folder, limit_file, usage_file, cache_key in (
            ("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        limit = _read_int(f"{folder}/{limit_file}")
        usage = _read_int(f"{folder}/{usage_file}")
        if limit is None or usage is None or limit >= total:
            continue
        cache = 0
        with contextlib.suppress(OSError, ValueError):
            with open(f"{folder}/memory.stat") as f:
                cache = next((int(v) for k, v in (line.split() for line in f) if k == cache_key), 0)
        return limit, max(0, limit - usage + cache)
    return None


def host_memory(local_ranks: int) -> tuple[int, str]:
    """Bytes of host memory this node's ``local_ranks`` ranks may use together, and how that was
    found: ``MemAvailable`` (what the kernel can give without swapping: other processes' memory
    is not in it) plus this rank's resident bytes times ``local_ranks`` (each rank's baseline is
    already resident and also in the plan), capped by ``MemTotal`` and a cgroup limit."""
    info = _meminfo()
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    held = local_ranks * _rss()
    figure = min(total, available + held)
    source = (f"{_gib(available)} available + {_gib(held)} held by its {_ranks(local_ranks)}, "
              f"of {_gib(total)} total")
    room = _cgroup_room(total)
    if room is not None and room[1] + held < figure:
        figure = min(room[0], room[1] + held)
        source += f", cgroup limit {_gib(room[0])}"
    return figure, source


def device_memory() -> tuple[int, str]:
    """Bytes of this rank's CUDA device the run may use: its free memory (what other processes
    hold is not free) plus this process's CUDA context, which the plan counts; at most the total."""
    import torch

    from engram_train.memory_plan.fixed import CUDA_CONTEXT_BYTES

    index = int(os.environ.get("LOCAL_RANK", "0"))
    free, total = torch.cuda.mem_get_info(index)
    return (min(total, free + CUDA_CONTEXT_BYTES),
            f"cuda:{index} ({_gib(free)} free of {_gib(total)}, + its CUDA context)")


def this_machine(local_ranks: int) -> Machine:
    import torch

    host, host_source = host_memory(local_ranks)
    if not torch.cuda.is_available():
        return Machine("cpu", host, host_source)
    device, device_source = device_memory()
    return Machine("cuda", host, host_source, device, device_source)


def plan_run(cfg, vocab_size: int, machine: Machine, world: int, local_ranks: int):
    """The plan of ``cfg`` on ``world`` ranks, ``local_ranks`` per node, against ``machine``;
    builds the model on the meta device under a one-process group it starts and ends."""
    from engram_train.memory_plan.plan_cli import make_plan, one_rank

    quiet = logging.getLogger("engram_train.runtime.distributed")
    was = quiet.disabled
    quiet.disabled = os.environ.get("RANK", "0") != "0"  # its start-up line: once, on rank 0
    try:
        with one_rank():
            return make_plan(cfg, world, local_ranks, vocab_size, machine.device,
                             machine.device_memory, machine.host_memory)
    finally:
        quiet.disabled = was


def check_memory(cfg, vocab_size: int, machine: Machine | None = None):
    """``system.memory_check``: refuse (``refuse``) or warn about (``warn``) a run whose plan
    does not fit ``machine`` (default: `this_machine`); warn at ``tight``. Returns the plan
    (None with ``off``, when torch.distributed already runs in this process, or when the plan
    fails: a warning names the error and the run starts)."""
    import torch.distributed as dist

    mode = cfg.system.memory_check
    if mode == "off":
        return None
    if dist.is_available() and dist.is_initialized():
        log.warning("memory check skipped: torch.distributed already runs in this process")
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    started = time.perf_counter()
    machine = machine or this_machine(local_ranks)
    try:
        plan = plan_run(cfg, vocab_size, machine, world, local_ranks)
    except Exception as e:  # the check guards the run; a plan it cannot make does not stop it
        log.warning("memory check skipped: the plan of this run failed (%s: %s); engram-plan with "
                    "the same overrides shows it, system.memory_check=off skips it", type(e).__name__, e)
        return None
    seconds = time.perf_counter() - started
    verdict = plan.verdict
    if verdict == "no" and mode == "refuse":
        raise MemoryCheckError(f"memory check: {_shortfall(plan, machine)}; {FIX}")
    if os.environ.get("LOCAL_RANK", "0") != "0":  # one report per node
        return plan
    if verdict == "no":
        log.warning("memory check: %s; starting anyway (system.memory_check=warn)", _shortfall(plan, machine))
    elif verdict == "tight":
        log.warning("memory check: tight: %s; it may run out of memory (planned in %.1f s)",
                    _figures(plan, machine, margin=True), seconds)
    else:
        log.info("memory check: fits: %s (planned in %.1f s)", _figures(plan, machine), seconds)
    return plan


def _figures(plan, machine: Machine, margin: bool = False) -> str:
    """The plan's figures against the machine's, for each memory: ``X GiB per ... of Y``."""
    from engram_train.memory_plan.plan_report import FIT_MARGIN

    raised = (lambda n: f" ({_gib(n * (1 + FIT_MARGIN))} with the plan's +{FIT_MARGIN:.0%} error)"
              if margin else "")
    lay = plan.layout
    per_rank = plan.total_bytes_per_rank if plan.device == "cpu" else plan.host_bytes_per_rank
    what = "peak RSS" if plan.device == "cpu" else "host memory"
    parts = []
    if plan.device != "cpu":
        parts.append(f"{_gib(plan.device_bytes_per_rank)} of device memory per rank"
                     f"{raised(plan.device_bytes_per_rank)} and {machine.device_source} has "
                     f"{_gib(machine.device_memory)} for it")
    parts.append(f"{_gib(plan.host_bytes_per_node)} of host memory per node ({_ranks(lay.nproc_per_node)} "
                 f"x {_gib(per_rank)} {what}){raised(plan.host_bytes_per_node)} and this "
                 f"host has {_gib(machine.host_memory)} for it ({machine.host_source})")
    return "the plan of this run needs " + "; ".join(parts)


def _shortfall(plan, machine: Machine) -> str:
    """The figures, and the largest planned item with the fields that change it."""
    item = plan.largest(1)[0]
    return (f"{_figures(plan, machine)}; the largest item, {item['item']} ({_gib(item['bytes'])} "
            f"a rank), changes with {item['change'] or 'the layout'}; engram-plan with the same "
            "overrides itemizes the plan")
