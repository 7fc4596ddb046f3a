"""Start and stop a job: torch.distributed, megatron parallel_state, Engram groups, seeds.

One entry point for every launcher (torchrun, a test, a single process): NCCL when CUDA is
present, gloo otherwise (with the CPU compatibility layer installed first).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engram_train.errors import ConfigError
from engram_train.parallel.groups import (
    check_engram_embedding_parallel_size,
    destroy_engram_parallel,
    initialize_engram_parallel,
)
from engram_train.runtime.patches import (
    active_patches,
    apply_megatron_fixes,
    install_cpu_compat,
    megatron_core_version,
)

logger = logging.getLogger(__name__)
_PATCHES_LOGGED = False


@dataclass(frozen=True)
class ParallelSizes:
    """The model-parallel layout of a job; data parallel is what remains of the world.

    ``engram_embedding`` is the Engram embedding-parallel size (``engram_embedding_parallel_size``
    of method ``alltoall``): the ranks of a pipeline stage that share each Engram table's rows,
    independent of ``tensor``; it must divide tensor x data x context (a stage's ranks).
    """

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    expert: int = 1
    context: int = 1
    engram_embedding: int = 1

    def megatron_kwargs(self) -> dict:
        """The sizes under megatron's names (``initialize_model_parallel`` and its configs)."""
        return dict(
            tensor_model_parallel_size=self.tensor,
            pipeline_model_parallel_size=self.pipeline,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline,
            context_parallel_size=self.context,
            expert_model_parallel_size=self.expert,
        )

    def validate(self, world_size: int) -> None:
        for name in ("tensor", "pipeline", "expert", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}_model_parallel_size must be >= 1, got {getattr(self, name)}")
        model = self.tensor * self.pipeline * self.context
        if world_size % model:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor ({self.tensor}) x pipeline "
                f"({self.pipeline}) x context ({self.context}) = {model}; change the parallel sizes "
                f"or the number of processes"
            )
        dp = world_size // model
        if (dp * self.context) % self.expert:
            raise ConfigError(
                f"expert_model_parallel_size {self.expert} must divide data-parallel x context size "
                f"{dp * self.context} (world {world_size} / tensor {self.tensor} / pipeline {self.pipeline})"
            )
        check_engram_embedding_parallel_size(
            self.engram_embedding,
            self.tensor * self.context * dp,
            f" = tensor ({self.tensor}) x context ({self.context}) x data ({dp}) (world "
            f"{world_size} / pipeline {self.pipeline})",
        )


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_distributed(
    parallel: ParallelSizes = ParallelSizes(),
    seed: int = 1234,
    timeout_minutes: int = 10,
) -> None:
    """Initialize torch.distributed (from torchrun's env, or as a single process), megatron's
    parallel state and the Engram groups (``engram_train.parallel.groups``).

    Applies the megatron-core patches first (``runtime/patches.py``; an untested megatron-core
    release is refused there) and logs the active ones once, on global rank 0.
    Safe to call once per process; ``destroy_distributed`` undoes it.
    """
    cuda = torch.cuda.is_available()
    if not cuda:
        install_cpu_compat()
    apply_megatron_fixes()

    if not dist.is_initialized():
        # Everything imported so far (torch, megatron-core: ~400k objects) lives as long as the
        # process: kept out of the collector's full passes, each of which would otherwise walk
        # it again (~0.2 s a pass; `release_parallel_groups` runs one per layout).
        gc.freeze()
        rank = int(os.environ.setdefault("RANK", "0"))
        world = int(os.environ.setdefault("WORLD_SIZE", "1"))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # One process rendezvous with nobody: an in-memory store, no port. (A port written to
        # MASTER_PORT would be inherited by every child process, whose own single-process
        # init would then find it taken by this one.)
        store = dist.HashStore() if world == 1 else None
        dist.init_process_group(
            backend="nccl" if cuda else "gloo",
            rank=rank,
            world_size=world,
            store=store,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    else:  # another layout in the same process: the previous layout's groups are released
        release_parallel_groups()
    parallel.validate(dist.get_world_size())
    global _PATCHES_LOGGED
    if dist.get_rank() == 0 and not _PATCHES_LOGGED:
        _PATCHES_LOGGED = True
        logger.info(
            "megatron-core %s; patches active: %s",
            megatron_core_version(), ", ".join(active_patches()) or "none",
        )

    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        **parallel.megatron_kwargs(), distributed_timeout_minutes=timeout_minutes
    )
    initialize_engram_parallel(parallel.engram_embedding, parallel.pipeline)
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker.

    Each pipeline stage gets its own offset (as Megatron-LM does) so stages don't share
    dropout masks; TP ranks are handled by megatron's tracker.
    """
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def release_parallel_groups() -> None:
    """Forget megatron's and Engram's groups and shut down every process group but the default
    one. megatron's ``destroy_model_parallel`` only drops its references (and its gloo
    data-parallel groups): each gloo group keeps transport threads until it is shut down, so a
    process that initializes layout after layout would otherwise collect thousands of threads
    (the objects still referenced keep theirs until they are freed)."""
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    destroy_engram_parallel()
    parallel_state.destroy_model_parallel()
    world = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    # A gloo group's threads end with the group object; models and optimizers of the previous
    # layout that hold it are often only reachable through reference cycles.
    gc.collect()


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    destroy_engram_parallel()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
