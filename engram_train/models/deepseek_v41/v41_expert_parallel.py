"""DeepSeek-V4.1's expert parallelism: the exact dispatch of its routed experts and their
checkpoint view (``v41_moe.DeepseekV41Experts``).

The dispatch is an all-to-all, as megatron's token dispatcher. The routed pairs leave sorted
by expert (`v41_grouped_experts.route`: token order within each expert), so they are already
grouped by destination rank. Per MoE layer:

1. the per-expert counts go to the experts' ranks in one small all-to-all, and the counts of
   both ways are read to the host once (`v41_grouped_experts.host_counts`): the exchange
   splits and the local experts' counts;
2. ONE all-to-all of ``[pairs, hidden + c]`` rows in the model dtype: the token's hidden row
   gathered straight into the send buffer and its float32 routing weight bit-packed into
   ``c = 4 / itemsize`` columns (2 under bf16, 1 under float32); the expert ids are not sent
   (the receiver knows them from the counts); one gather regroups the received pairs by local
   expert (source rank, then token order within an expert: one process's order over the EP
   group's tokens);
3. the experts' outputs in the model dtype (float32 accumulation inside the GEMMs) go back by
   the reverse all-to-all, ``[pairs, hidden]``, and each token adds its contributions in
   float32 in ascending expert order (`v41_grouped_experts.combine`), as in one process.

Bytes per routed pair and direction: ``(hidden + c) x itemsize`` out (``2 hidden + 4`` under
bf16), ``hidden x itemsize`` back (``2 hidden``), as megatron's all-to-all dispatcher (rows and
float32 probabilities out, rows back); the backward the same, reversed. Each exchange's adjoint
is the reverse exchange, in one autograd node per direction, so every rank runs the backward
exchanges in the same order, one that received or sent no pair included. A rank's expert
weights see the tokens of the whole EP group, as under megatron's dispatchers: their gradient
is that of the EP group's loss, which DDP reduces over the expert data-parallel group only
(``allreduce = False``).
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


def weight_columns(dtype: torch.dtype) -> int:
    """Columns of `dtype` that carry one float32 routing weight in the exchanged rows."""
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size >= 4 else 4 // size


def _pack(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[n]`` -> ``[n, weight_columns(dtype)]`` of `dtype` (exact both ways)."""
    weight = weight.float().contiguous()
    if torch.empty((), dtype=dtype).element_size() >= 4:
        return weight.to(dtype)[:, None]
    return weight.view(dtype).view(weight.shape[0], weight_columns(dtype))


def _unpack(cols: torch.Tensor) -> torch.Tensor:
    if cols.element_size() >= 4:
        return cols[:, 0].float()
    return cols.contiguous().view(torch.float32).view(-1)


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
    """Rows and routing weights to the experts' ranks in one all-to-all (module docstring)."""

    @staticmethod
    def forward(ctx, x, pair_weights, transfer, comm):
        token = transfer.routing.token
        h, c = x.shape[1], weight_columns(x.dtype)
        send = x.new_empty(token.shape[0], h + c)
        torch.index_select(x, 0, token, out=send[:, :h])
        send[:, h:] = _pack(pair_weights, x.dtype)
        recv = _exchange(send, transfer.send_splits, transfer.recv_splits, comm)
        ctx.save_for_backward(token, transfer.group, transfer.ungroup)
        ctx.meta = (x.shape, x.dtype, transfer.send_splits, transfer.recv_splits, comm)
        return recv[:, :h].index_select(0, transfer.group), _unpack(recv[:, h:])[transfer.group]

    @staticmethod
    def backward(ctx, grad_rows, grad_weights):
        token, group, ungroup = ctx.saved_tensors
        shape, dtype, send_splits, recv_splits, comm = ctx.meta
        h, c = shape[1], weight_columns(dtype)
        back = grad_rows.new_empty(grad_rows.shape[0], h + c)
        torch.index_select(grad_rows.to(dtype), 0, ungroup, out=back[:, :h])
        back[:, h:] = _pack(grad_weights[ungroup], dtype)
        sent = _exchange(back, recv_splits, send_splits, comm)
        grad_x = sent.new_zeros(shape, dtype=torch.float32).index_add_(0, token, sent[:, :h].float())
        return grad_x.to(dtype), _unpack(sent[:, h:]), None, None


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

    def send(self, x: torch.Tensor, weights: torch.Tensor, transfer: Transfer):
        """``x [tokens, hidden]``, the router's ``weights [tokens, k]`` (differentiable) -> the
        rows this rank's experts serve and their float32 routing weights, grouped by local
        expert (``transfer.local_counts`` each)."""
        pair_weights = transfer.routing.pair_weights(weights)
        if self.size == 1:
            return gather_rows(x, transfer.routing.token), pair_weights
        return _Dispatch.apply(x, pair_weights, transfer, self.group)

    def receive(self, contributions: torch.Tensor, transfer: Transfer) -> torch.Tensor:
        """The experts' outputs (grouped by local expert) -> this rank's pairs, in its send
        order (expert order), for `v41_grouped_experts.combine`."""
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
