"""EngramMemory: an inference export served from host memory, one decoding step at a time.

The three stages a serving stack runs per step, in order (docs/export.md, "Serving"):

1. `hash(state, token_ids)`: the new tokens' table addresses, from each sequence's last N-1
   compressed ids (O(1) per token; bit-exact with training's hashing of the full sequence);
2. `lookup(layer_id, hash_ids)`: gather the rows from the memory-mapped table (host memory;
   only the touched pages are ever read); `prefetch` does 1 + 2 for every layer and moves the
   rows to the device;
3. `forward(layer_id, hidden, memory, state)`: the dense part (gate, value, short conv) on the
   device, continuing each sequence's causal conv from its last (K-1)*N normalized values
   (with ``reset_at_eos``, never reading before a position's document start).

The dense part is `engram_train.engram.engram_module.Engram` itself, loaded from the export, so its
numerics are the training module's. Tensors are batch-first here ([B, T, d] or [B, T, G, d]);
the residual is the caller's: ``h = h + forward(...)``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engram_train.engram.engram_module import Engram, ShortConv
from engram_train.engram.reference_io import load_reference_state_dict
from engram_train.errors import InputError, InputTypeError
from engram_train.export.format import (
    HASH_FILE,
    LOOKUP_TENSOR,
    OFFSETS,
    TABLE,
    ExportedEngram,
    ExportFormatError,
    layer_tensor_names,
    load_export_config,
    multipliers_tensor,
    primes_tensor,
)
from engram_train.export.safetensors_io import MappedSafetensors
from engram_train.engram.incremental_hash import (
    IncrementalNgramHasher,
    continue_document_distance,
)

TABLE_MEMORY = ("map", "hugepages")


class _StreamingShortConv(nn.Module):
    """`ShortConv` that continues from per-sequence state instead of zero left padding.

    The conv is causal with dilation N and kernel K, so the output at t reads normalized values
    t - (K-1)*N .. t: those (K-1)*N values are the state. Starting from zeros equals the
    training module's zero padding. Same norms and conv weights as the wrapped module.
    """

    def __init__(self, conv: ShortConv) -> None:
        super().__init__()
        self.inner = conv
        self.state: torch.Tensor | None = None  # [B, G*d, (K-1)*N], set around each call

    def forward(self, x: torch.Tensor, document_distance: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``document_distance`` [S, B]: the look-back stops at document starts (the state's
        values before a start read as zero), as ``ShortConv.forward``."""
        seq, batch, streams, width = x.shape
        normed = self.inner.normalize(x)
        y = torch.cat([self.state, normed.permute(1, 2, 0)], dim=-1)  # [B, G*d, state + S]
        self.state = y[..., y.shape[-1] - self.inner.left_pad:].clone()
        if document_distance is None:
            y = self.inner.conv(y)
        else:
            y = self.inner._conv_within_documents(y, document_distance)
        y = nn.functional.silu(y)
        return y.permute(2, 0, 1).reshape(seq, batch, streams, width)


@dataclass
class EngramState:
    """Decoding state of a batch of sequences (one slot per sequence).

    `history` (int64 [B, N-1]): last compressed ids, oldest first; `conv[layer]`
    ([B, G*d, (K-1)*N] on the device): last normalized values of that layer's short conv.
    `hashed` counts the tokens hashed; `applied[layer]` those the layer has consumed.
    With ``engram_reset_at_eos``, `since_start` (int64 [B]) is where the next token lies in
    its document and `distances` (int64 [B, n]) the document distances of the hashed tokens
    from number `distances_from` on, for the short conv.
    """

    history: np.ndarray
    conv: dict[int, torch.Tensor]
    pad_id: int
    hashed: int = 0
    applied: dict[int, int] = field(default_factory=dict)
    since_start: np.ndarray | None = None
    distances: np.ndarray | None = None
    distances_from: int = 0

    @property
    def batch_size(self) -> int:
        return int(self.history.shape[0])

    def reset(self, slots: Sequence[int] | None = None) -> None:
        """Start new sequences in `slots` (default: all): pad history, zero conv state."""
        index = slice(None) if slots is None else list(slots)
        self.history[index] = self.pad_id
        if self.since_start is not None:
            self.since_start[index] = 0
        for conv in self.conv.values():
            conv[index] = 0

    def copy_slot_(self, slot: int, other: "EngramState", other_slot: int = 0) -> None:
        """Take `other`'s sequence in `other_slot` into `slot` (e.g. a prompt prefilled alone
        joining a decoding batch)."""
        self.history[slot] = other.history[other_slot]
        if self.since_start is not None and other.since_start is not None:
            self.since_start[slot] = other.since_start[other_slot]
        for layer, conv in self.conv.items():
            conv[slot] = other.conv[layer][other_slot]


class EngramMemory:
    """The Engram layers of an export, for inference: hashing, host-table gathers, dense part.

    `device` and `dtype` place the dense part (default: CPU, the export's dtype). Tables stay
    on the host, as `tables`:
    - ``"map"`` (default): copy-on-write maps of the layer files; nothing is read until rows
      are gathered, and the pages are the kernel's page cache;
    - ``"hugepages"``: each table read once into anonymous memory advised for transparent huge
      pages. Costs the tables' size in RAM (not reclaimable), but a random row read then
      rarely misses the TLB: gathers ran 12x faster than from the map on a 4 KiB-page VM
      (docs/export.md). Needs THP enabled (``always`` or ``madvise``).
    `layer_ids` restricts to some layers (e.g. those of one pipeline stage).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        layer_ids: Sequence[int] | None = None,
        tables: str = "map",
    ) -> None:
        if tables not in TABLE_MEMORY:
            raise InputError(f"tables={tables!r} must be one of {TABLE_MEMORY}")
        self.export: ExportedEngram = load_export_config(path)
        self.path = Path(path)
        self.device = torch.device(device)
        e = self.export
        wanted = list(e.layer_ids) if layer_ids is None else [int(i) for i in layer_ids]
        unknown = sorted(set(wanted) - set(e.layer_ids))
        if unknown:
            raise InputError(f"layer_ids {unknown} are not Engram layers of this export "
                             f"({list(e.layer_ids)})")
        self.layer_ids = wanted

        hash_file = MappedSafetensors(self.path / HASH_FILE)
        lookup = hash_file.tensor(LOOKUP_TENSOR).numpy()
        multipliers, primes = {}, {}
        for layer_id in self.layer_ids:
            layer = e.layers[layer_id]
            multipliers[layer_id] = hash_file.tensor(multipliers_tensor(layer_id)).numpy()
            primes[layer_id] = hash_file.tensor(primes_tensor(layer_id)).numpy()
            if (multipliers[layer_id].tolist() != list(layer.multipliers)
                    or primes[layer_id].tolist() != list(layer.flat_primes)):
                raise ExportFormatError(
                    f"{self.path}: layer {layer_id} hash constants in {HASH_FILE} differ from "
                    "engram_config.json; the export is corrupt, export it again"
                )
        if lookup.shape != (e.num_raw_ids,) or int(lookup.max()) + 1 != e.compressed_vocab_size:
            raise ExportFormatError(f"{self.path}: {LOOKUP_TENSOR} does not match the tokenizer "
                                    "sizes in engram_config.json; export it again")
        self.hasher = IncrementalNgramHasher(
            lookup, multipliers, primes, e.max_ngram_size, e.n_head_per_ngram,
            pad_id=e.compressed_pad_id, eos_id=e.eos_id if e.reset_at_eos else None,
        )

        config = e.engram_config()
        self.tables: dict[int, torch.Tensor] = {}
        self.offsets: dict[int, torch.Tensor] = {}
        self._buffers: list[mmap.mmap] = []  # keep resident tables' memory alive
        self.layers = nn.ModuleDict()
        for layer_id in self.layer_ids:
            file = MappedSafetensors(self.path / e.layers[layer_id].file)
            expected = set(layer_tensor_names(e.hc_mult))
            if set(file.keys()) != expected:
                raise ExportFormatError(
                    f"{file.path}: tensors {sorted(set(file.keys()) ^ expected)} differ from the "
                    f"Engram layer's (hc_mult={e.hc_mult})"
                )
            table = file.tensor(TABLE)
            if tuple(table.shape) != (e.layers[layer_id].num_rows, e.head_dim):
                raise ExportFormatError(
                    f"{file.path}: table of shape {tuple(table.shape)}, engram_config.json gives "
                    f"({e.layers[layer_id].num_rows}, {e.head_dim})"
                )
            offsets = file.tensor(OFFSETS)
            if offsets.tolist() != list(e.layers[layer_id].offsets):
                raise ExportFormatError(f"{file.path}: head offsets differ from engram_config.json")
            # An empty row range: the table stays in the file, the module holds the dense part.
            module = Engram(config, e.hidden_size, layer_id, row_start=0, row_end=0,
                            device="cpu", dtype=dtype or file.tensor("value_proj.weight").dtype)
            dense = {name: file.tensor(name) for name in expected if name != TABLE}
            load_reference_state_dict(module, dense, strict=False)
            module.short_conv = _StreamingShortConv(module.short_conv)
            self.layers[str(layer_id)] = module.to(self.device).eval().requires_grad_(False)
            if tables == "hugepages":
                table, buffer = resident_table(table)
                self._buffers.append(buffer)
            self.tables[layer_id] = table
            self.offsets[layer_id] = offsets.clone()

    # -- state ----------------------------------------------------------------------------

    @property
    def conv_state_length(self) -> int:
        return (self.export.kernel_size - 1) * self.export.max_ngram_size

    def new_state(self, batch_size: int) -> EngramState:
        """State of `batch_size` empty sequences."""
        channels = self.export.hc_mult * self.export.hidden_size
        conv = {
            layer_id: torch.zeros(batch_size, channels, self.conv_state_length,
                                  device=self.device, dtype=self._dtype(layer_id))
            for layer_id in self.layer_ids
        }
        documents = self.hasher.eos_id is not None
        return EngramState(self.hasher.new_history(batch_size), conv, self.hasher.pad_id,
                           applied={layer_id: 0 for layer_id in self.layer_ids},
                           since_start=np.zeros(batch_size, np.int64) if documents else None,
                           distances=np.zeros((batch_size, 0), np.int64) if documents else None)

    def _dtype(self, layer_id: int) -> torch.dtype:
        return self.layers[str(layer_id)].value_proj.weight.dtype

    # -- 1. hashing -----------------------------------------------------------------------

    def hash(self, state: EngramState, token_ids) -> dict[int, torch.Tensor]:
        """Head-local hash ids {layer: int64 [B, T, K]} of `token_ids` ([B, T] or [B]: one new
        token per sequence) appended to `state`'s sequences; advances the hashing state."""
        ids = token_ids.cpu().numpy() if isinstance(token_ids, torch.Tensor) else np.asarray(
            token_ids)
        if ids.size == 0 and ids.dtype == np.float64 and not isinstance(token_ids, torch.Tensor):
            ids = ids.astype(np.int64)  # numpy reads an empty list ([[]]) as float64
        if ids.ndim == 1:
            ids = ids[:, None]
        hashed = self.hasher.extend(state.history, ids)
        if state.since_start is not None:
            distance, state.since_start = continue_document_distance(
                ids, self.hasher.eos_id, state.since_start)
            state.distances = np.concatenate([state.distances, distance], axis=1)
        state.hashed += ids.shape[1]
        return {layer_id: torch.from_numpy(hashed[i])
                for i, layer_id in enumerate(self.hasher.layer_ids)}

    # -- 2. gathering rows ----------------------------------------------------------------

    def lookup(self, layer_id: int, hash_ids: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Rows for head-local `hash_ids` [..., K] from the host table -> memory [..., K*D]
        (host, the table's dtype). `out` (e.g. a pinned buffer) receives them if given."""
        table = self.tables[layer_id]
        rows = gather_table_rows(table, (hash_ids + self.offsets[layer_id]).reshape(-1),
                                 None if out is None else out.view(-1, table.shape[1]))
        return rows.view(*hash_ids.shape[:-1], hash_ids.shape[-1] * table.shape[1])

    def prefetch(self, state: EngramState, token_ids) -> dict[int, torch.Tensor]:
        """Hash the new tokens and gather every layer's rows onto the device:
        {layer: memory [B, T, E]}, ready for `forward`."""
        pin = self.device.type == "cuda"  # gather into page-locked memory: async copies
        memory = {}
        for layer_id, hash_ids in self.hash(state, token_ids).items():
            table = self.tables[layer_id]
            out = torch.empty((*hash_ids.shape[:-1], hash_ids.shape[-1] * table.shape[1]),
                              dtype=table.dtype, pin_memory=pin)
            rows = self.lookup(layer_id, hash_ids, out=out)
            memory[layer_id] = rows.to(self.device, non_blocking=pin)
        return memory

    def prefault(self) -> None:
        """Touch every page of every table once (e.g. at server start): the first gathers
        from a fresh map otherwise pay a page fault per page they touch."""
        for table in self.tables.values():
            flat = table.view(-1)
            step = max(1, 4096 // table.element_size())
            flat[::step].sum()

    # -- 3. dense part --------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, layer_id: int, hidden_states: torch.Tensor, memory: torch.Tensor,
                state: EngramState) -> torch.Tensor:
        """Engram output (residual not included) for the newest T positions: hidden [B, T, d]
        (or [B, T, G, d]) and their memory [B, T, E] -> [B, T, d]; advances the conv state."""
        module = self.layers[str(layer_id)]
        dtype = self._dtype(layer_id)
        if hidden_states.dtype != dtype:
            raise InputTypeError(
                f"layer {layer_id}: hidden_states has dtype {hidden_states.dtype}, this EngramMemory "
                f"runs in {dtype} (its dtype argument, or the export's): pass "
                f"hidden_states.to({dtype})"
            )
        steps = hidden_states.shape[1]
        if state.applied[layer_id] + steps > state.hashed:
            raise InputError(
                f"layer {layer_id}: {steps} positions given, but only "
                f"{state.hashed - state.applied[layer_id]} hashed tokens are waiting: call hash "
                "(or prefetch) with the new tokens first"
            )
        if steps == 0:  # an empty prompt: nothing to compute, the conv state stays
            return hidden_states.new_empty(hidden_states.shape)
        conv = module.short_conv
        conv.state = state.conv[layer_id]
        try:
            # Sequence-first and contiguous, as the training module computes it.
            y = module(hidden_states.transpose(0, 1).contiguous(),
                       memory=memory.to(self.device).transpose(0, 1).contiguous(),
                       document_distance=self._distances(state, layer_id, steps))
            state.conv[layer_id] = conv.state
        finally:
            conv.state = None
        state.applied[layer_id] += steps
        self._drop_consumed_distances(state)
        return y.transpose(0, 1)

    # -- checks ---------------------------------------------------------------------------

    def _distances(self, state: EngramState, layer_id: int, steps: int) -> torch.Tensor | None:
        """[S, B] document distances of the layer's next ``steps`` positions (reset at EOS)."""
        if state.distances is None:
            return None
        start = state.applied[layer_id] - state.distances_from
        window = state.distances[:, start : start + steps]
        return torch.from_numpy(np.ascontiguousarray(window.T)).to(self.device)

    @staticmethod
    def _drop_consumed_distances(state: EngramState) -> None:
        if state.distances is None:
            return
        done = min(state.applied.values()) - state.distances_from
        if done > 0:
            state.distances = state.distances[:, done:]
            state.distances_from += done

    def check_tokenizer(self, tokenizer_file: str | os.PathLike) -> None:
        """Raise if `tokenizer_file` is not the tokenizer the export was trained with."""
        import hashlib

        from engram_train.engram.compressed_tokenizer import resolve_tokenizer_file

        file = resolve_tokenizer_file(tokenizer_file, field="tokenizer_file")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if digest != self.export.tokenizer_sha256:
            raise InputError(
                f"{file} (sha256 {digest[:12]}...) is not the tokenizer this export was trained "
                f"with (sha256 {self.export.tokenizer_sha256[:12]}...): every Engram address "
                "would change; serve with the export's tokenizer.json"
            )


HUGE_PAGE = 2 << 20


def resident_table(table: torch.Tensor, block_bytes: int = 64 << 20
                   ) -> tuple[torch.Tensor, mmap.mmap]:
    """A copy of `table` in anonymous memory advised for transparent huge pages (2 MiB-aligned),
    filled block by block; returns it and the buffer that owns its memory."""
    nbytes = table.numel() * table.element_size()
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then map 2 MiB
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    resident = raw[start:start + nbytes].view(table.dtype).view(table.shape)
    rows = max(1, block_bytes // max(1, table[0].numel() * table.element_size()))
    for first in range(0, table.shape[0], rows):
        resident[first:first + rows].copy_(table[first:first + rows])
    return resident, buffer


SMALL_GATHER_BYTES = 2 << 20
"""Gathers up to this size run on the calling thread: waking torch's intra-op threads costs
more than they save there (and much more on a busy host); larger ones use them."""

_NUMPY_VIEW = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: move the same bits


def gather_table_rows(table: torch.Tensor, rows: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """table[rows] for a [R, D] host table (memory-mapped or not) and int64 rows [n] ->
    [n, D], into `out` if given (e.g. a pinned buffer). Out-of-range rows raise."""
    if out is None:
        out = torch.empty((rows.numel(), table.shape[1]), dtype=table.dtype)
    if rows.numel() * table.shape[1] * table.element_size() > SMALL_GATHER_BYTES:
        return torch.index_select(table, 0, rows, out=out)
    index = rows.numpy()
    if index.size and (index.min() < 0 or index.max() >= table.shape[0]):
        raise IndexError(f"rows outside the table's [0, {table.shape[0]})")
    view = _NUMPY_VIEW.get(table.dtype, table.dtype)
    # mode="clip" (the range is checked above) writes into `out` without a staging buffer
    np.take(table.view(view).numpy(), index, axis=0, out=out.view(view).numpy(), mode="clip")
    return out
