"""Context and sequence parallelism for the Engram branch: which positions of the sequence a
rank holds, and the short conv's left context (the *halo*) from the positions before them.

Vocabulary (used in ``models/engram_layer.py`` and docs/embedding-parallel.md):

- *zigzag*: megatron's context-parallel split (``zigzag_split``): the sequence is cut into
  ``2 x CP`` chunks and CP rank ``r`` holds chunks ``r`` and ``2CP-1-r``, in that order.
- *sequence group*: the ranks whose positions together make one sequence: the CP group, or with
  sequence parallelism the tensor x context group (TP rank ``t`` then holds the ``t``-th
  ``1/TP`` slice of its CP rank's positions, as megatron's ``scatter_to_sequence_parallel_region``).
- *piece*: a run of consecutive global positions on one rank (two per rank under CP).
- *halo*: the ``P = (kernel_size - 1) x max_ngram_size`` positions before a piece's first one.
  The dilated causal conv reads exactly those; the piece at position 0 gets zeros, the
  reference's left padding.

Hash ids are computed on the whole sequence next to the data loader and split with the tokens
(``context_parallel_batch``), so every position's ids equal the unsplit run's. The halo moves
only the ``P`` rows per piece a rank needs, with one ``all_to_all_single`` over the sequence
group (its backward returns each row's gradient to its owner), instead of gathering the
sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engram_train.errors import InputError

HASH_KEY = "engram_hash_ids"
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def zigzag_split(batch: dict, cp_group) -> dict:
    """megatron's per-sequence zigzag split of ``batch``'s tensors (dim 1; attention masks
    dim 2). megatron-core 0.16 names it ``get_batch_on_this_cp_rank(batch, cp_group)``; 0.17+
    puts a dispatcher there (packed and hybrid CP) and keeps this split as
    ``_get_batch_on_this_cp_rank_per_sequence_balancing(batch, cp_group)``."""
    from megatron.core import utils

    split = getattr(utils, "_get_batch_on_this_cp_rank_per_sequence_balancing", None)
    if split is not None:
        return split(batch, cp_group=cp_group)
    return utils.get_batch_on_this_cp_rank(batch, cp_group)


def context_parallel_batch(batch: dict, cp_group=None) -> dict:
    """This CP rank's zigzag share of a micro-batch (megatron's split, ``zigzag_split``), the
    ``[L, B, S, K]`` hash-id block included (split on S like the tokens). A new dict; the
    batch is returned as is without context parallelism."""
    from megatron.core import parallel_state

    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
    size = cp_group.size()
    if size == 1:
        return batch
    seq = batch["tokens"].shape[1]
    if seq % (2 * size):
        raise InputError(
            f"seq_length={seq} must be a multiple of 2 x context_parallel_size = {2 * size} "
            "(megatron's zigzag cuts every sequence into 2 x CP chunks)"
        )
    out = dict(batch)
    out.update(zigzag_split(
        {k: batch[k] for k in SEQUENCE_KEYS if batch.get(k) is not None}, cp_group))
    ids = batch.get(HASH_KEY)
    if ids is not None:
        if not isinstance(ids, torch.Tensor):
            raise InputError("context parallelism needs the [L, B, S, K] hash-id block "
                             "(NgramHashMapping.hash_stacked), not a per-layer mapping")
        layers, b, _, k = ids.shape
        flat = zigzag_split({"ids": ids.reshape(layers * b, seq, k)}, cp_group)
        out[HASH_KEY] = flat["ids"].reshape(layers, b, -1, k)
    return out


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions (int64) of CP rank ``cp_rank``'s local sequence, in local order (the
    order of megatron's split, checked against it in the tests)."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise InputError(f"seq_length={seq_len} is not a multiple of 2 x CP = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def held_positions(seq_len: int, cp_size: int, cp_rank: int, tp_size: int = 1,
                   tp_rank: int = 0) -> torch.Tensor:
    """Global positions a rank holds: its zigzag share, then its sequence-parallel slice."""
    local = zigzag_positions(seq_len, cp_size, cp_rank)
    if local.numel() % tp_size:
        raise InputError(f"{local.numel()} local positions do not split over TP={tp_size}")
    width = local.numel() // tp_size
    return local[tp_rank * width : (tp_rank + 1) * width]


def pieces_of(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Local [start, end) of every run of consecutive global positions."""
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, positions.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class HaloPlan:
    """What one rank of a sequence group sends and receives for the conv's left contexts.

    ``pieces``: local [start, end) runs; ``width``: P; ``send_index``: local positions sent,
    grouped by destination (``send_splits``); received rows (``recv_splits`` per source) land at
    ``fill_index`` of the ``[len(pieces) * P]`` left-context buffer, the rest stays zero
    (before position 0)."""

    pieces: tuple[tuple[int, int], ...]
    width: int
    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    fill_index: torch.Tensor
    recv_splits: tuple[int, ...]
    edges: int  # pieces that do not start at position 0


def plan_halo(layout: list[torch.Tensor], me: int, width: int) -> HaloPlan:
    """The halo plan of group rank ``me`` when group rank ``q`` holds ``layout[q]`` (global
    positions in local order). Every rank derives every rank's requests from the layout alone,
    so senders and receivers agree on the order without exchanging it."""
    seq = sum(p.numel() for p in layout)
    owner = torch.empty(seq, dtype=torch.int64)
    index = torch.empty(seq, dtype=torch.int64)
    for q, pos in enumerate(layout):
        owner[pos] = q
        index[pos] = torch.arange(pos.numel())

    def requests(q: int):  # (source rank, source local index, slot) of every halo row of q
        out = []
        for k, (start, _) in enumerate(pieces_of(layout[q])):
            first = int(layout[q][start])
            for j in range(width):
                p = first - width + j
                if p >= 0:
                    out.append((int(owner[p]), int(index[p]), k * width + j))
        return out

    size = len(layout)
    send: list[list[int]] = [[] for _ in range(size)]
    for q in range(size):
        for src, idx, _ in sorted(requests(q)):
            if src == me:
                send[q].append(idx)
    mine = sorted(requests(me))
    pieces = pieces_of(layout[me])
    return HaloPlan(
        pieces=tuple(pieces), width=width,
        send_index=torch.tensor([i for idx in send for i in idx], dtype=torch.int64),
        send_splits=tuple(len(idx) for idx in send),
        fill_index=torch.tensor([slot for _, _, slot in mine], dtype=torch.int64),
        recv_splits=tuple(sum(1 for src, _, _ in mine if src == q) for q in range(size)),
        edges=sum(1 for start, _ in pieces if int(layout[me][start]) > 0),
    )


class _HaloExchange(torch.autograd.Function):
    """Rows of ``x`` [S_local, ...] to the ranks whose pieces follow them; returns the
    ``[pieces * P, ...]`` left contexts. Backward: the reverse all-to-all, each row's gradient
    added to its owner's position."""

    @staticmethod
    def forward(ctx, x, plan: HaloPlan, group):
        ctx.plan, ctx.group, ctx.rows = plan, group, x.shape[0]
        send = x.index_select(0, plan.send_index.to(x.device)).contiguous()
        recv = x.new_empty((sum(plan.recv_splits), *x.shape[1:]))
        dist.all_to_all_single(recv, send, list(plan.recv_splits), list(plan.send_splits),
                               group=group)
        HALO_STATS.count(recv)
        left = x.new_zeros((len(plan.pieces) * plan.width, *x.shape[1:]))
        left.index_copy_(0, plan.fill_index.to(x.device), recv)
        return left

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        grad_recv = grad.index_select(0, plan.fill_index.to(grad.device)).contiguous()
        grad_send = grad.new_empty((sum(plan.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_send, grad_recv, list(plan.send_splits),
                               list(plan.recv_splits), group=ctx.group)
        grad_x = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        grad_x.index_add_(0, plan.send_index.to(grad.device), grad_send)
        return grad_x, None, None


@dataclass
class HaloStats:
    """Bytes of halo rows this process received since ``reset`` (for tests and benchmarks)."""

    bytes: int = 0
    calls: int = 0

    def count(self, recv: torch.Tensor) -> None:
        self.bytes += recv.numel() * recv.element_size()
        self.calls += 1

    def reset(self) -> None:
        self.bytes = self.calls = 0


HALO_STATS = HaloStats()


class SequenceHalo:
    """The left contexts of this rank's pieces over a sequence group (module docstring).

    ``group``: the sequence group; ``coords[g] = (cp_rank, tp_rank)`` of group rank ``g``.
    Plans are built once per sequence length."""

    def __init__(self, group, coords: list[tuple[int, int]], cp_size: int, tp_size: int,
                 width: int) -> None:
        self.group, self.coords, self.width = group, coords, width
        self.cp_size, self.tp_size = cp_size, tp_size
        self._plans: dict[int, HaloPlan] = {}

    def plan(self, local_len: int) -> HaloPlan:
        if local_len not in self._plans:
            seq = local_len * self.tp_size * self.cp_size
            layout = [held_positions(seq, self.cp_size, c, self.tp_size, t)
                      for c, t in self.coords]
            self._plans[local_len] = plan_halo(layout, self.group.rank(), self.width)
        return self._plans[local_len]

    def left_contexts(self, x: torch.Tensor) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """(pieces, left contexts ``[pieces, P, ...]``) for ``x`` [S_local, ...]."""
        plan = self.plan(x.shape[0])
        left = _HaloExchange.apply(x, plan, self.group)
        return list(plan.pieces), left.unflatten(0, (len(plan.pieces), plan.width))


def sequence_halo(config, width: int, tp_group=None, cp_group=None) -> SequenceHalo | None:
    """The Engram layer's halo, or None when one rank holds the whole sequence (the conv's
    own zero padding is then the reference). With sequence parallelism the group is megatron's
    tensor x context group, whose ranks megatron orders TP-fastest (checked here)."""
    from megatron.core import parallel_state

    cp = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    tp = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    cp_size, tp_size = cp.size(), tp.size()
    split_tp = bool(config.sequence_parallel) and tp_size > 1
    if not split_tp:
        if cp_size == 1:
            return None
        return SequenceHalo(cp, [(c, 0) for c in range(cp_size)], cp_size, 1, width)
    if cp_size == 1:
        return SequenceHalo(tp, [(0, t) for t in range(tp_size)], 1, tp_size, width)
    group = parallel_state.get_tensor_and_context_parallel_group()
    if group.rank() != cp.rank() * tp_size + tp.rank():
        raise RuntimeError(
            f"tensor x context group rank {group.rank()} is not cp_rank x TP + tp_rank "
            f"({cp.rank()} x {tp_size} + {tp.rank()}): megatron's rank order changed"
        )
    coords = [(g // tp_size, g % tp_size) for g in range(group.size())]
    return SequenceHalo(group, coords, cp_size, tp_size, width)
