"""The rank layout a plan is made for: parallel sizes, data parallelism, micro-batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Sizes of one run. ``dp`` is megatron's data-parallel size (world / (TP x PP x CP));
    ``expert_dp`` the data-parallel size of expert parameters (world / (EP x ETP x PP));
    ``table_shards`` the ranks a table is row-sharded over (Engram embedding-parallel size for
    ``alltoall``, TP for ``allreduce``)."""

    world: int
    nproc_per_node: int
    tp: int
    pp: int
    vpp: int | None
    ep: int
    etp: int
    cp: int
    dp: int
    expert_dp: int
    sequence_parallel: bool
    table_shards: int
    micro_batch_size: int
    seq_length: int
    num_micro: int  # micro-batches of one step per data-parallel rank
    distributed_optimizer: bool
    train_iters: int | None = None  # steps of the run (None: a long run)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (context parallelism splits the sequence)."""
        return self.micro_batch_size * self.seq_length // self.cp


def layout_of(cfg, model_config, world: int, nproc_per_node: int) -> Layout:
    """The layout of a validated config (``validate_run_config`` checked the divisibility)."""
    from engram_train.training.run_config import data_parallel_size, parallel_sizes, sequence_parallel

    p = parallel_sizes(cfg)
    t, m = cfg.train, model_config
    dp = data_parallel_size(cfg, world)
    etp = int(m.expert_tensor_parallel_size or p.tensor)
    if m.use_engram:
        shards = p.tensor if m.engram_embedding_parallel_method == "allreduce" else int(m.engram_embedding_parallel_size)
    else:
        shards = 1
    return Layout(
        world=world, nproc_per_node=nproc_per_node, tp=p.tensor, pp=p.pipeline,
        vpp=p.virtual_pipeline, ep=p.expert, etp=etp, cp=p.context, dp=dp,
        expert_dp=world // (p.expert * etp * p.pipeline), sequence_parallel=sequence_parallel(cfg),
        table_shards=shards, micro_batch_size=int(t.micro_batch_size), seq_length=int(t.seq_length),
        num_micro=int(t.global_batch_size) // (int(t.micro_batch_size) * dp),
        distributed_optimizer=bool(cfg.system.use_distributed_optimizer),
        train_iters=int(t.train_iters) if t.get("train_iters") else None,
    )  # fmt: skip
