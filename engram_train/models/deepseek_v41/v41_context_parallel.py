"""Context parallelism for DeepSeek-V4.1: each CP rank holds megatron's zigzag share of the
sequence (``parallel.context.zigzag_positions``: chunks ``r`` and ``2 CP - 1 - r`` of ``2 CP``)
and computes its own queries; the keys come from every rank.

What crosses the CP group per layer, gathered along the sequence and put back in global order
(megatron's ``gather_from_sequence_parallel_region`` over the CP group: an all-gather whose
backward reduce-scatters the keys' gradients back to the ranks that made them):

- the window K=V (``head_dim`` values per token: 1 KiB at V4.1-Flash's 512 in bf16); a query
  reads at most ``sliding_window - 1`` keys before its piece (the left halo), gathered whole
  here as NeMo Automodel does;
- on a full layer, the compressed keys (``head_dim / r`` per token) and the index keys
  (``index_head_dim / r``, no gradient: the indexer is frozen);
- once per forward, the token ids (int64, to find the documents of a packed row).

A compressed run must not cross a piece boundary: the chunk ``seq_length / (2 CP)`` is a
multiple of every compression ratio (refused in one line otherwise). The Engram branch of
V4.1 has no short conv, so it needs nothing from other ranks (its hash ids are computed on the
whole sequence before the split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engram_train.errors import InputError
from engram_train.parallel.context import zigzag_positions


@dataclass
class ContextShare:
    """This rank's share of a sequence of ``length`` tokens over the CP group."""

    group: object
    size: int
    rank: int
    length: int
    positions: torch.Tensor
    """``[s_local]`` int64: the global positions of the local tokens, in local order."""
    order: torch.Tensor
    """Global order of the all-gathered tokens (rank 0's, rank 1's, ...)."""

    def pieces(self) -> list[tuple[int, int, int]]:
        """``(local start, global start, length)`` of the local runs of consecutive positions."""
        chunk = self.length // (2 * self.size)
        return [(0, self.position_of(0), chunk), (chunk, self.position_of(chunk), chunk)]

    def position_of(self, index: int) -> int:
        """The global position of local token `index` (host arithmetic, no device read)."""
        chunk = self.length // (2 * self.size)
        if index < chunk:
            return self.rank * chunk + index
        return (2 * self.size - 1 - self.rank) * chunk + index - chunk

    def gather(self, local: torch.Tensor, ratio: int = 1) -> torch.Tensor:
        """``[s_local / ratio, ...]``, the local tokens or their compressed runs of `ratio`
        (each piece's runs whole: `check_runs`) -> ``[length / ratio, ...]`` in global order
        (gradients go back)."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        gathered = gather_from_sequence_parallel_region(local.contiguous(), True, self.group)
        order = (self.order if ratio == 1 else
                 global_order(self.length // ratio, self.size, gathered.device))
        return gathered.index_select(0, order)

    def check_runs(self, ratio: int) -> None:
        chunk = self.length // (2 * self.size)
        if chunk % ratio:
            raise InputError(f"seq_length={self.length} over context_parallel_size={self.size} "
                             f"gives chunks of {chunk} tokens, not a multiple of the "
                             f"compression ratio {ratio}: use a seq_length that is a multiple "
                             f"of 2 x CP x {ratio} = {2 * self.size * ratio}.")


def global_order(length: int, size: int, device) -> torch.Tensor:
    """The order that puts the all-gathered zigzag shares of a sequence of `length` (rank 0's,
    rank 1's, ...) back into the sequence's order."""
    shares = torch.cat([zigzag_positions(length, size, rank) for rank in range(size)])
    return torch.argsort(shares).to(device)


def context_share(local_length: int, device) -> ContextShare | None:
    """This rank's `ContextShare` of a sequence whose local share is `local_length` tokens, or
    None without context parallelism."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return None
    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return None
    if local_length % 2:
        raise InputError(f"a context-parallel share of {local_length} tokens is not two equal "
                         "chunks: seq_length must be a multiple of 2 x context_parallel_size.")
    rank, length = parallel_state.get_context_parallel_rank(), local_length * size
    return ContextShare(parallel_state.get_context_parallel_group(), size, rank, length,
                        zigzag_positions(length, size, rank).to(device),
                        global_order(length, size, device))


def whole_sequence_ids(input_ids: torch.Tensor, share: ContextShare) -> torch.Tensor:
    """``[b, s_local]`` token ids -> ``[b, length]``: the whole rows, in order (no gradient)."""
    import torch.distributed as dist

    parts = [torch.empty_like(input_ids) for _ in range(share.size)]
    dist.all_gather(parts, input_ids.contiguous(), group=share.group)
    return torch.cat(parts, dim=1).index_select(1, share.order)
