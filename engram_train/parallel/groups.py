"""Engram process groups, kept next to megatron's ``parallel_state`` and shaped like it.

Vocabulary (used across ``engram_train.parallel`` and docs/embedding-parallel.md):

- *stage ranks*: the ranks of one pipeline stage, i.e. its tensor x context x data-parallel
  ranks. Engram tables live on the stage that owns their layer, so every Engram group is formed
  inside one stage.
- *Engram embedding-parallel group*: ``eps`` consecutive stage ranks (global rank order,
  so tensor-parallel peers are grouped first, as megatron lays them out). Each member owns a
  contiguous block of rows of every Engram table of the stage; lookups are routed to the owners
  with all-to-all (method ``alltoall``). Independent of the tensor-parallel size.
- *Engram data-parallel group*: the stage ranks with the same embedding-parallel rank. They hold
  the same rows, so table gradients are summed over it (and scaled like megatron DDP scales
  every other gradient).
- *Engram model-parallel group*: the ranks with the same Engram data-parallel rank on every
  stage. Together they hold each table row of the model exactly once: the table gradient norm
  is summed over it.

``initialize_engram_parallel`` must run on every rank after megatron's
``initialize_model_parallel`` (``engram_train.runtime.initialize_distributed`` does both);
``destroy_engram_parallel`` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from engram_train.errors import ConfigError


@dataclass(frozen=True)
class _EngramGroups:
    embedding_parallel_size: int
    embedding_parallel_group: dist.ProcessGroup
    embedding_parallel_ranks: tuple[int, ...]
    data_parallel_group: dist.ProcessGroup
    data_parallel_ranks: tuple[int, ...]
    model_parallel_group: dist.ProcessGroup
    model_parallel_ranks: tuple[int, ...]


_GROUPS: _EngramGroups | None = None


def check_engram_embedding_parallel_size(eps: int, stage_size: int, detail: str = "") -> None:
    """``eps`` must split every pipeline stage's ranks into equal groups."""
    if isinstance(eps, bool) or not isinstance(eps, int) or eps < 1:
        raise ConfigError(f"engram_embedding_parallel_size must be >= 1 (an int), got {eps!r}")
    if stage_size % eps:
        raise ConfigError(
            f"engram_embedding_parallel_size={eps} must divide the number of ranks of a pipeline "
            f"stage, {stage_size}{detail}: Engram tables live on the stage that owns their layer, "
            f"so their embedding-parallel groups are formed inside one stage. Use a divisor of "
            f"{stage_size}."
        )


def initialize_engram_parallel(
    embedding_parallel_size: int = 1,
    pipeline_model_parallel_size: int | None = None,
) -> None:
    """Create the Engram embedding-parallel, data-parallel and model-parallel groups.

    Collective over the default group (every rank creates every group, in the same order).
    The stage of a rank is megatron's pipeline rank; ``pipeline_model_parallel_size`` defaults
    to megatron's. Calling it again replaces the groups.
    """
    from megatron.core import parallel_state

    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_engram_parallel needs torch.distributed: call "
            "engram_train.runtime.initialize_distributed first."
        )
    if _GROUPS is not None:
        destroy_engram_parallel()
    world = dist.get_world_size()
    pp = pipeline_model_parallel_size or parallel_state.get_pipeline_model_parallel_world_size()
    stage_size = world // pp
    check_engram_embedding_parallel_size(
        embedding_parallel_size,
        stage_size,
        f" (world size {world} / pipeline {pp}: tensor x context x data parallel)",
    )
    eps = embedding_parallel_size

    # Which ranks form each stage: megatron's pipeline rank of every rank, in global order.
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    stage_of = [None] * world
    dist.all_gather_object(stage_of, pp_rank)
    stages = [[r for r in range(world) if stage_of[r] == s] for s in range(pp)]
    if any(len(ranks) != stage_size for ranks in stages):
        raise RuntimeError(f"pipeline stages have unequal rank counts: {stages}")

    me = dist.get_rank()
    num_replicas = stage_size // eps
    mine: dict[str, tuple[int, ...]] = {}
    groups: dict[str, dist.ProcessGroup] = {}

    def make(kind: str, ranks: list[int]) -> None:
        group = dist.new_group(ranks)  # collective: every rank calls it for every group
        if me in ranks:
            mine[kind], groups[kind] = tuple(ranks), group

    for ranks in stages:  # embedding-parallel groups: consecutive stage ranks
        for start in range(0, stage_size, eps):
            make("embedding", ranks[start : start + eps])
    for ranks in stages:  # Engram data-parallel groups: same embedding-parallel rank in a stage
        for shard in range(eps):
            make("data", ranks[shard::eps])
    for replica in range(num_replicas):  # every row once: one Engram data-parallel rank, all stages
        make("model", [r for ranks in stages for r in ranks[replica * eps : (replica + 1) * eps]])

    _GROUPS = _EngramGroups(
        embedding_parallel_size=eps,
        embedding_parallel_group=groups["embedding"],
        embedding_parallel_ranks=mine["embedding"],
        data_parallel_group=groups["data"],
        data_parallel_ranks=mine["data"],
        model_parallel_group=groups["model"],
        model_parallel_ranks=mine["model"],
    )


def destroy_engram_parallel() -> None:
    """Forget the Engram groups, as megatron's ``destroy_model_parallel`` forgets its own (the
    default group's teardown releases them)."""
    global _GROUPS
    _GROUPS = None


def is_engram_parallel_initialized() -> bool:
    return _GROUPS is not None


def _groups() -> _EngramGroups:
    if _GROUPS is None:
        raise RuntimeError(
            "Engram parallel groups are not initialized: call "
            "engram_train.runtime.initialize_distributed (or initialize_engram_parallel after "
            "megatron's initialize_model_parallel)."
        )
    return _GROUPS


def get_engram_embedding_parallel_group() -> dist.ProcessGroup:
    return _groups().embedding_parallel_group


def get_engram_embedding_parallel_world_size() -> int:
    return _groups().embedding_parallel_size


def get_engram_embedding_parallel_rank() -> int:
    return _groups().embedding_parallel_ranks.index(dist.get_rank())


def get_engram_embedding_parallel_ranks() -> tuple[int, ...]:
    return _groups().embedding_parallel_ranks


def get_engram_data_parallel_group() -> dist.ProcessGroup:
    return _groups().data_parallel_group


def get_engram_data_parallel_world_size() -> int:
    return len(_groups().data_parallel_ranks)


def get_engram_data_parallel_rank() -> int:
    return _groups().data_parallel_ranks.index(dist.get_rank())


def get_engram_data_parallel_ranks() -> tuple[int, ...]:
    return _groups().data_parallel_ranks


def get_engram_model_parallel_group() -> dist.ProcessGroup:
    return _groups().model_parallel_group


def get_engram_model_parallel_ranks() -> tuple[int, ...]:
    return _groups().model_parallel_ranks


def table_gradient_groups(config) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(group to sum table gradients over, group to sum their squared norm over) of the
    model's method; every rank has them, with or without tables of its own.

    ``alltoall``: the Engram data-parallel and model-parallel groups. ``allreduce``: megatron's
    data-parallel (with context) group and its model-parallel (TP x PP) group.
    """
    from megatron.core import parallel_state

    if config.engram_embedding_parallel_method == "allreduce":
        return (
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            parallel_state.get_model_parallel_group(),
        )
    return get_engram_data_parallel_group(), get_engram_model_parallel_group()
