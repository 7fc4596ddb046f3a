"""Multi-head Engram embedding: all heads of one layer in one row-shardable table.

Every head's prime-sized table is concatenated into a single `weight` [rows, D] (row = hash +
head offset), so sharding is a contiguous row range per rank and the optimizer sees one
parameter per layer. A rank holds rows [row_start, row_end); on a single rank that is all rows.
Under model parallelism a *method* object (`engram_train.parallel.AllToAllLookup` or
`AllReduceLookup`) picks the rows and does the sharded lookup.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engram_train.engram.fp8_table import FP8_DTYPE, SCALE_ATTR, scale_blocks, store_rows
from engram_train.engram.ngram_hash import head_offsets
from engram_train.engram.host_table import is_host_resident, make_host_resident
from engram_train.engram.row_grad import gather_rows
from engram_train.errors import InputError

INIT_BLOCK_ROWS = 4096
"""Rows per independently seeded init block. Part of the init's definition: changing it
changes every initial table value."""

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def init_block_seed(seed: int, layer_id: int, block: int) -> int:
    """Seed of one init block, a well-mixed function of (seed, layer_id, block index)."""
    h = _splitmix64(int(seed) & _MASK64)
    h = _splitmix64(h ^ (int(layer_id) & _MASK64))
    h = _splitmix64(h ^ (int(block) & _MASK64))
    return h >> 1  # 63 bits: valid for every torch.Generator.manual_seed


@torch.no_grad()
def partition_invariant_normal_(
    weight: torch.Tensor,
    seed: int,
    layer_id: int,
    row_start: int,
    std: float,
    block_rows: int = INIT_BLOCK_ROWS,
) -> torch.Tensor:
    """Fill `weight` (global rows [row_start, row_start + len)) with N(0, std^2) such that
    global row r's value depends only on (seed, layer_id, r, row width) and not on sharding.

    Rows come in fixed blocks of `block_rows`, each drawn in full from a CPU generator seeded by
    (seed, layer_id, block) and sliced, so any row range reproduces the single-rank values.
    """
    if weight.ndim != 2:
        raise InputError(f"expected a [rows, dim] table, got shape {tuple(weight.shape)}.")
    if weight.is_meta or weight.shape[0] == 0:
        return weight
    num_rows, dim = weight.shape
    row_end = row_start + num_rows
    generator = torch.Generator(device="cpu")
    block_values = torch.empty((block_rows, dim), dtype=torch.float32)
    for block in range(row_start // block_rows, (row_end - 1) // block_rows + 1):
        generator.manual_seed(init_block_seed(seed, layer_id, block))
        block_values.normal_(mean=0.0, std=std, generator=generator)
        first = block * block_rows
        lo, hi = max(row_start, first), min(row_end, first + block_rows)
        weight[lo - row_start : hi - row_start].copy_(block_values[lo - first : hi - first])
    return weight


def mark_engram_param(param: nn.Parameter, table: bool = False) -> nn.Parameter:
    """Tag a parameter for the Engram optimizer group (`is_engram`); tables also get
    `is_engram_table` (sparse rows: LR multiplier, no weight decay, optional host offload)."""
    param.is_engram = True
    if table:
        param.is_engram_table = True
    return param


class MultiHeadEmbedding(nn.Module):
    """Lookup of a layer's K head tables: hash ids [..., K] -> memory [..., K * D].

    `weight` holds global rows [row_start, row_end) of the concatenated table; `offsets`
    (int64 [K]) are the head starts. On a full table (single rank) `forward` is a plain gather;
    a shard can do the masked partial lookup of vocab-parallel embeddings (`lookup_rows`).
    With `parallel` (an embedding-parallel method object) the rows come from
    `parallel.row_range(num_rows)` and `forward` looks up through `parallel.lookup`.
    `placement='host'` keeps `weight` in host memory whatever `device` is (`host_table.py`).
    """

    def __init__(
        self,
        head_sizes: Sequence[int],
        embedding_dim: int,
        *,
        layer_id: int,
        seed: int = 0,
        init_std: float = 0.02,
        row_start: int = 0,
        row_end: int | None = None,
        parallel=None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        placement: str = "device",
    ) -> None:
        super().__init__()
        if placement not in ("device", "host"):
            raise InputError(f"placement={placement!r} must be 'device' or 'host'.")
        self.head_sizes = [int(n) for n in head_sizes]
        self.num_heads = len(self.head_sizes)
        self.embedding_dim = int(embedding_dim)
        self.num_rows = sum(self.head_sizes)
        self.layer_id = int(layer_id)
        self.seed = int(seed)
        self.init_std = float(init_std)
        self.parallel = parallel
        if parallel is not None:
            if row_start != 0 or row_end is not None:
                raise InputError(
                    "give either row_start/row_end or an embedding-parallel method, not both: "
                    "the method decides which rows this rank holds."
                )
            row_start, row_end = parallel.row_range(self.num_rows)
        row_end = self.num_rows if row_end is None else int(row_end)
        if not 0 <= row_start <= row_end <= self.num_rows:
            raise InputError(
                f"row range [{row_start}, {row_end}) must lie within the layer's table "
                f"[0, {self.num_rows})."
            )
        self.row_start, self.row_end = int(row_start), row_end
        offsets = torch.from_numpy(head_offsets(self.head_sizes))
        self.register_buffer("offsets", offsets.to(device=device))
        on_host = placement == "host" and torch.device(device or "cpu").type != "meta"
        self.weight = nn.Parameter(
            torch.empty((row_end - row_start, self.embedding_dim), dtype=dtype,
                        device="cpu" if on_host else device)
        )
        if on_host:
            make_host_resident(self.weight)
        self._host_scale = on_host  # an fp8 table's scales stay with its rows
        if dtype == FP8_DTYPE:  # E8M0 scales per row and block of 32 columns (fp8_table.py)
            scale = torch.zeros((row_end - row_start, scale_blocks(self.embedding_dim)),
                                dtype=torch.uint8, device="cpu" if on_host else device)
            self.register_buffer("weight_scale", scale)
            setattr(self.weight, SCALE_ATTR, scale)
        mark_engram_param(self.weight, table=True)
        self.weight.engram_layer_id = self.layer_id  # named in the table optimizer's errors
        self.weight.engram_row_start = self.row_start  # global row ids key stochastic rounding
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.dtype != FP8_DTYPE:
            partition_invariant_normal_(
                self.weight, self.seed, self.layer_id, self.row_start, self.init_std
            )
            return
        if self.weight.is_meta:
            return
        # fp8: the same float32 init, quantized (round to nearest even) by blocks of rows,
        # small enough that the temporaries stay a few MB whatever the table size
        rows = self.weight.shape[0]
        for lo in range(0, rows, INIT_BLOCK_ROWS):
            hi = min(rows, lo + INIT_BLOCK_ROWS)
            values = torch.empty((hi - lo, self.embedding_dim), dtype=torch.float32)
            partition_invariant_normal_(
                values, self.seed, self.layer_id, self.row_start + lo, self.init_std)
            local = torch.arange(lo, hi, device=self.weight.device)
            store_rows(self.weight, local, values.to(self.weight.device))

    def _apply(self, fn, recurse: bool = True):
        """An fp8 table's scales follow its rows: kept in host memory with host placement
        (as the builder keeps the rows), and re-attached to the parameter after any move."""
        scale = self._buffers.get("weight_scale")
        if scale is not None and self._host_scale:
            self._buffers["weight_scale"] = None
        out = super()._apply(fn, recurse)
        if scale is not None:
            if self._host_scale:
                self._buffers["weight_scale"] = scale
            if self._parameters.get("weight") is not None:
                setattr(self.weight, SCALE_ATTR, self._buffers["weight_scale"])
        return out

    @property
    def is_full_table(self) -> bool:
        return self.row_start == 0 and self.row_end == self.num_rows

    def extra_repr(self) -> str:
        method = f", method={self.parallel.method}" if self.parallel is not None else ""
        method += ", host-resident" if is_host_resident(self.weight) else ""
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, dim={self.embedding_dim}, "
            f"rows=[{self.row_start}, {self.row_end}) of {self.num_rows}{method}"
        )

    def table_rows(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Head-local hashes [..., K] -> global table rows [..., K]."""
        if hash_ids.shape[-1] != self.num_heads:
            raise InputError(
                f"hash ids have {hash_ids.shape[-1]} heads in their last dim, this layer's table "
                f"has {self.num_heads} ((max_ngram_size - 1) * n_head_per_ngram)."
            )
        return hash_ids + self.offsets

    def lookup_rows(self, rows: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """Gather global rows [...] -> [..., D]. With `partial`, rows owned by other ranks give
        zeros (the caller sums over the shards); without it the table must be full.

        Each distinct row is read once; the backward is row-sparse for a table armed by the
        table optimizer (``engram/row_grad.py``)."""
        if not partial and not self.is_full_table:
            raise RuntimeError(
                f"table of layer {self.layer_id} is a shard [{self.row_start}, "
                f"{self.row_end}); use the sharded lookup or lookup_rows(partial=True)."
            )
        unique, inverse = torch.unique(rows.reshape(-1), sorted=True, return_inverse=True)
        local = unique - self.row_start
        owned = None
        if partial:
            owned = (local >= 0) & (local < self.weight.shape[0])
            local = torch.where(owned, local, 0)
        values = gather_rows(self.weight, local, owned)
        return values.index_select(0, inverse).view(*rows.shape, self.embedding_dim)

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Hash ids [..., K] -> memory [..., K * D] (``issue`` waited at once)."""
        return self.issue(hash_ids, prefetch=False).wait()

    def issue(self, hash_ids: torch.Tensor, prefetch: bool = True):
        """Start this lookup (the next-layer prefetch): returns an object whose ``wait()``
        gives the memory [..., K * D], the same values bit for bit whenever it is waited.
        Sharded tables send their rows asynchronously in between (with ``prefetch``); a full
        local table is read right away."""
        rows = self.table_rows(hash_ids)
        if self.parallel is None:
            return _Ready(self.lookup_rows(rows).flatten(-2))
        return _Flattened(self.parallel.issue(self, rows, prefetch=prefetch))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron dist_checkpointing view: the table as row-block ShardedTensor pieces of one
        key placed by global row (``engram/table_pieces.py``: a checkpoint saved under one
        sharding or piece size loads under another; a resume reads one piece at a time),
        replicas named by the method's replica id; the head offsets as a replicated tensor. Called by megatron's
        ``sharded_state_dict_default`` through the Engram module."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        from engram_train.engram.table_pieces import row_pieces_factory

        if sharded_offsets:
            raise InputError(
                f"Engram table of layer {self.layer_id} got sharded offsets {sharded_offsets}: "
                "Engram layers are not homogeneous, build the model's sharded state dict with "
                "metadata={'non_homogeneous_layers': True} (engram_train.checkpoint.state does)."
            )
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group, dp_cp_group = _tensor_parallel_group(), metadata["dp_cp_group"]
        state = make_sharded_tensors_for_checkpoint(
            {"offsets": self.offsets}, prefix, {}, (), tp_group=tp_group, dp_cp_group=dp_cp_group
        )
        if self.parallel is not None:
            replica_id = self.parallel.checkpoint_shard()[2]
        else:  # a full table replicated like any megatron tensor outside TP
            replica_id = (0, _rank(tp_group), _rank(dp_cp_group))
        tensors = {"weight": self.weight}
        if "weight_scale" in self._buffers:  # fp8: the scales, sharded like the rows
            tensors["weight_scale"] = self.weight_scale
        for name, tensor in tensors.items():  # row-block pieces (engram/table_pieces.py)
            key = f"{prefix}{name}"
            state[key] = row_pieces_factory(key, tensor, self.num_rows, self.row_start, replica_id)
        return state


class _Ready:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def advance(self) -> bool:
        return False

    def wait(self) -> torch.Tensor:
        return self.value


class _Flattened:
    def __init__(self, pending) -> None:
        self.pending = pending

    def advance(self) -> bool:
        return self.pending.advance()

    def wait(self) -> torch.Tensor:
        return self.pending.wait().flatten(-2)


def _tensor_parallel_group():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _rank(group) -> int:
    return group.rank() if group is not None else 0
