"""DeepSeek-V4.1's expert parallelism: the exact dispatch of its routed experts and their
checkpoint view (``v41_moe.DeepseekV41Experts``).

The dispatch is an all-to-all, as megatron's token dispatcher: every (token, choice) pair is
sent, with its routing weight, to the rank holding its expert, grouped by destination rank and
in token order within it; each rank runs its experts on the pairs it received (an expert sees
the EP group's tokens in rank order, then token order); the float32 contributions come back by
the reverse all-to-all, and each token's contributions are added in ascending expert order,
the order of one process's loop over its experts, so a token's sum is one process's sum.
Backward: each exchange's adjoint is the reverse exchange. Traffic per rank and MoE layer is
about ``top-k x tokens x hidden`` each way, whatever ``ep`` (an all-gather of the group's
tokens and an all-reduce of an ``[ep x tokens, hidden]`` sum, as this dispatch was first, grew
with ``ep``). A rank's expert weights see the tokens of the whole EP group, as under
megatron's dispatchers: their gradient is that of the EP group's loss, which DDP reduces over
the expert data-parallel group only (``allreduce = False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engram_train.errors import InputError


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _ExchangeRows(torch.autograd.Function):
    """All-to-all of one or more row tensors with the same uneven splits, in one autograd node,
    so that every rank runs the reverse exchanges of its backward in the same order (an unused
    output's gradient is zeros: every rank takes part, also one that received no pair)."""

    @staticmethod
    def forward(ctx, send_splits, recv_splits, group, *tensors):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return tuple(_exchange(t, send_splits, recv_splits, group) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        send_splits, recv_splits = ctx.splits
        return (None, None, None, *(_exchange(g, recv_splits, send_splits, ctx.group) for g in grads))


@dataclass
class Route:
    """Where this rank's (token, choice) pairs went: ``token`` and ``expert`` (global id) per
    sent pair, in send order, and the per-rank counts both ways."""

    token: torch.Tensor
    expert: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]


class ExpertParallelDispatch:
    """The dispatch over `group` (module docstring); size 1 (or no group) has no exchange."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.size = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0

    def send(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, num_local: int):
        """``x [tokens, hidden]``, ``weights [tokens, k]`` (differentiable), expert choices
        ``[tokens, k]`` (-1: none) -> the pairs this rank's experts serve: their rows, routing
        weights and local expert ids (by source rank, then source token), and the `Route`."""
        token, slot = torch.where(chosen >= 0)  # token order, then slot
        expert = chosen[token, slot]
        owner = torch.div(expert, num_local, rounding_mode="floor")
        order = torch.sort(owner, stable=True)[1]  # grouped by owner, token order kept
        token, slot, expert, owner = token[order], slot[order], expert[order], owner[order]
        send_counts = torch.bincount(owner, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        route = Route(token, expert, send_counts.tolist(), recv_counts.tolist())
        args = (route.send_splits, route.recv_splits, self.group)
        rows, pair_weights = _ExchangeRows.apply(*args, x[token], weights[token, slot])
        local = _exchange(expert, *args) - self.rank * num_local
        return rows, pair_weights, local, route

    def combine(self, contributions: torch.Tensor, route: Route, tokens: int) -> torch.Tensor:
        """The float32 ``contributions`` of the received pairs back to their tokens:
        ``[tokens, hidden]``, each token's added in ascending expert order."""
        (back,) = _ExchangeRows.apply(route.recv_splits, route.send_splits, self.group, contributions)
        out = back.new_zeros((tokens, back.shape[1]))
        if not route.expert.numel():  # nothing sent: the exchange still joins the backward
            return out + back.sum()
        order = torch.sort(route.expert, stable=True)[1]
        counts = torch.unique_consecutive(route.expert[order], return_counts=True)[1]
        for rows in torch.split(order, counts.tolist()):  # in place: no copy of out per expert
            out.index_add_(0, route.token[rows], back[rows])
        return out


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
