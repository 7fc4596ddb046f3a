"""DeepSeek-V4.1's expert parallelism: the exact dispatch of its routed experts and their
checkpoint view (``v41_moe.DeepseekV41Experts``).

The dispatch gathers the EP group's tokens (``[tokens, hidden]``), routing weights and expert
choices on every rank, each rank adds its own experts' contributions for all of them into a
float32 ``[ep * tokens, hidden]`` sum, and the sums are added over the group (all-reduce), each
rank keeping its own rows. Backward: the gradient of the gathered inputs is summed over the
group and sliced (the gather's adjoint), and the gradient of a rank's own rows is gathered
into every rank's sum (the reduction's adjoint). Only all-gather and all-reduce are used, which
every backend has (gloo has no reduce-scatter). A rank's expert weights thus see the tokens of
the whole EP group, as under megatron's token dispatchers: their gradient is that of the EP
group's loss, which DDP reduces over the expert data-parallel group only (``allreduce =
False``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engram_train.errors import InputError


def _gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _own_rows(x: torch.Tensor, rows: int, group) -> torch.Tensor:
    start = group.rank() * rows
    return x[start:start + rows]


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward: the gradient summed over the group, own rows kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rows = group, x.shape[0]
        return _gather_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _own_rows(grad, ctx.rows, ctx.group).contiguous(), None


class _ReduceToOwnRows(torch.autograd.Function):
    """Sum over the group, own rows kept; backward: every rank's row gradients gathered."""

    @staticmethod
    def forward(ctx, x, rows, group):
        ctx.group = group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _own_rows(total, rows, group).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad.contiguous(), ctx.group), None, None


class ExpertParallelDispatch:
    """The dispatch over `group` (module docstring); size 1 (or no group) passes through."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.size = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0

    def gather(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor):
        """The EP group's ``x [tokens, hidden]``, ``weights [tokens, k]`` (differentiable) and
        expert choices ``[tokens, k]`` (-1: none), rank order."""
        if self.size == 1:
            return x, weights, chosen
        return (_GatherRows.apply(x, self.group), _GatherRows.apply(weights, self.group),
                _gather_rows(chosen, self.group))

    def reduce(self, out: torch.Tensor, rows: int) -> torch.Tensor:
        """This rank's `rows` of the group's summed contributions."""
        if self.size == 1:
            return out
        return _ReduceToOwnRows.apply(out, rows, self.group)


def expert_sharded_state_dict(module, names, dispatch: ExpertParallelDispatch, prefix: str,
                              sharded_offsets: tuple = ()) -> dict:
    """megatron dist_checkpointing view of `module`'s stacked expert tensors `names`: one
    ShardedTensor each over all experts, this rank's block on axis 0, replicas numbered by the
    expert data-parallel rank (a checkpoint saved under one EP size loads under another)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if sharded_offsets:
        raise InputError(f"{prefix}: the V4.1 experts take no outer sharded offsets.")
    replica = parallel_state.get_expert_data_parallel_rank()
    tp = parallel_state.get_expert_tensor_parallel_rank()
    return {f"{prefix}{name}": ShardedTensor.from_rank_offsets(
        f"{prefix}{name}", getattr(module, name), (0, dispatch.rank, dispatch.size),
        replica_id=(0, tp, replica)) for name in names}
