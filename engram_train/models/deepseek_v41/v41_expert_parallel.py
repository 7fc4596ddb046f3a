"""DeepSeek-V4.1's expert parallelism: the exact dispatch of its routed experts and their
checkpoint view (``v41_moe.DeepseekV41Experts``).

The dispatch is an all-to-all, as megatron's token dispatcher. The routed pairs leave sorted
by expert (`v41_grouped_experts.route`: token order within each expert), which is the order
(destination rank, local expert), so they are already grouped by destination rank. Per MoE
layer:

1. the per-expert counts (``experts`` ints, not per pair) go to the experts' ranks in one
   small all-to-all, and the counts of both ways are read to the host once
   (`v41_grouped_experts.host_counts`): the exchange splits and the local experts' counts;
2. ONE all-to-all of ``[pairs, hidden]`` rows in the model dtype, each token's hidden row
   gathered straight into the send buffer; nothing else travels: the receiver knows each
   row's local expert from the counts, and the routing weights stay on their tokens' rank.
   One gather regroups the received pairs by local expert (source rank, then token order
   within an expert: one process's order over the EP group's tokens);
3. the experts' unweighted outputs in the model dtype (float32 accumulation inside the GEMMs)
   go back by the reverse all-to-all, ``[pairs, hidden]``, and each token adds its
   contributions times their routing weights in float32 in ascending expert order
   (`v41_grouped_experts.combine`), as in one process.

Bytes per routed pair and direction: ``hidden x itemsize`` both ways (``2 hidden`` under bf16,
``4 hidden`` under float32), the backward the same, reversed: the rows' gradient goes back
in the model dtype, and the routing weights' gradient is computed where the weights are, from
the returned rows the combine keeps (as megatron's unpermute with probabilities keeps the
permuted tokens). megatron's all-to-all dispatcher sends the rows and float32 probabilities
out (``2 hidden + 4``). Each exchange's adjoint is the reverse exchange, in one autograd node
per direction, so every rank runs the backward exchanges in the same order, one that received
or sent no pair included. A rank's expert weights see the tokens of the whole EP group, as
under megatron's dispatchers: their gradient is that of the EP group's loss, which DDP reduces
over the expert data-parallel group only (``allreduce = False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engram_train.errors import InputError
from engram_train.models.deepseek_v41.v41_grouped_experts import Routing, gather_rows, host_counts


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


@dataclass
class Transfer:
    """One layer's exchange plan: the routed pairs (`Routing`), the per-rank splits both ways,
    the local experts' counts, and the permutation that regroups the received pairs by local
    expert (``group[j]``: the received pair at grouped position j; ``ungroup`` its inverse)."""

    routing: Routing
    send_splits: list[int]
    recv_splits: list[int]
    local_counts: list[int]
    group: torch.Tensor | None = None
    ungroup: torch.Tensor | None = None


class _Dispatch(torch.autograd.Function):
    """The routed pairs' rows to the experts' ranks in one all-to-all (module docstring)."""

    @staticmethod
    def forward(ctx, x, transfer, comm):
        send = x.index_select(0, transfer.routing.token)
        recv = _exchange(send, transfer.send_splits, transfer.recv_splits, comm)
        ctx.save_for_backward(transfer.routing.token, transfer.ungroup)
        ctx.meta = (x.shape, x.dtype, transfer.send_splits, transfer.recv_splits, comm)
        return recv.index_select(0, transfer.group)

    @staticmethod
    def backward(ctx, grad_rows):
        token, ungroup = ctx.saved_tensors
        shape, dtype, send_splits, recv_splits, comm = ctx.meta
        back = grad_rows.to(dtype).index_select(0, ungroup)
        sent = _exchange(back, recv_splits, send_splits, comm)
        grad_x = sent.new_zeros(shape, dtype=torch.float32).index_add_(0, token, sent.float())
        return grad_x.to(dtype), None, None


class _Return(torch.autograd.Function):
    """The experts' outputs (grouped by local expert) back to the ranks of their tokens."""

    @staticmethod
    def forward(ctx, contributions, transfer, comm):
        ctx.save_for_backward(transfer.group)
        ctx.meta = (transfer.send_splits, transfer.recv_splits, comm)
        send = contributions.index_select(0, transfer.ungroup)
        return _exchange(send, transfer.recv_splits, transfer.send_splits, comm)

    @staticmethod
    def backward(ctx, grad):
        (group,) = ctx.saved_tensors
        send_splits, recv_splits, comm = ctx.meta
        return _exchange(grad, send_splits, recv_splits, comm).index_select(0, group), None, None


class ExpertParallelDispatch:
    """The dispatch over `group` (module docstring); size 1 (or no group) has no exchange."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.size = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0

    def plan(self, routing: Routing, num_local: int) -> Transfer:
        """The counts exchange and the layer's one host read (module docstring, step 1)."""
        if self.size == 1:
            counts = host_counts(routing.counts)
            routing.finish(sum(counts))
            return Transfer(routing, [routing.pairs], [routing.pairs], counts)
        recv = torch.empty_like(routing.counts)
        dist.all_to_all_single(recv, routing.counts, group=self.group)
        both = host_counts(torch.cat([routing.counts, recv]))
        sent, got = both[: len(both) // 2], both[len(both) // 2:]
        routing.finish(sum(sent))
        send_splits = [sum(sent[r * num_local:(r + 1) * num_local]) for r in range(self.size)]
        recv_splits = [sum(got[r * num_local:(r + 1) * num_local]) for r in range(self.size)]
        local_counts = [sum(got[r * num_local + e] for r in range(self.size)) for e in range(num_local)]
        total = sum(recv_splits)
        device = routing.counts.device
        local = torch.repeat_interleave(torch.arange(num_local, device=device).repeat(self.size),
                                        recv, output_size=total)
        group = torch.sort(local, stable=True)[1]
        ungroup = torch.empty_like(group)
        ungroup[group] = torch.arange(total, device=device)
        return Transfer(routing, send_splits, recv_splits, local_counts, group, ungroup)

    def send(self, x: torch.Tensor, transfer: Transfer) -> torch.Tensor:
        """``x [tokens, hidden]`` -> the rows this rank's experts serve, grouped by local
        expert (``transfer.local_counts`` each)."""
        if self.size == 1:
            return gather_rows(x, transfer.routing.token)
        return _Dispatch.apply(x, transfer, self.group)

    def receive(self, contributions: torch.Tensor, transfer: Transfer) -> torch.Tensor:
        """The experts' outputs (grouped by local expert) -> this rank's pairs, in its send
        order (expert order), for `v41_grouped_experts.combine` with their routing weights."""
        if self.size == 1:
            return contributions
        return _Return.apply(contributions, transfer, self.group)


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
