"""DeepSeek-V4.1's n-gram hash: the paper hash (`ngram_hash.py`) with V4.1's look-back rule.

V4.1 hashes with the paper's machinery unchanged: the same compressed tokenizer, one numpy
PCG64 multiplier per n-gram position seeded by ``10007 * layer_id`` (seed 0), one prime walk
over all layers with a single ``seen`` set (every order's heads start above
``engram_vocab_size``, one number for all orders), XOR of int64 products, floor modulo. What
differs is where an n-gram stops looking back: at the sequence start, at a document start and
at a dead token (padding, or anything the caller masks out). Every token the n-gram at ``t``
would read from there on (``t`` itself included when ``t`` is dead) is the compressed pad id,
so ``t`` sees only the live run of its own document that ends at ``t``. Ids are bit-exact with
NeMo Automodel 0.7.0's ``DeepseekV41NgramHash`` (tests/test_deepseek_v41_engram.py).

`DeepseekV41EngramArgs` holds the V4.1 fields under V4.1's names; `engram/variant.py` maps an
`EngramConfig` with ``engram_variant=deepseek_v41`` onto them (docs/deepseek-v41.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from engram_train.engram.compressed_tokenizer import CompressedTokenizer, check_raw_ids
from engram_train.engram.ngram_hash import NgramHashMapping
from engram_train.errors import ConfigError, InputError, InputTypeError


@dataclass(frozen=True)
class DeepseekV41EngramArgs:
    """The Engram fields of a DeepSeek-V4.1 text config, under its names; the defaults are the
    released V4.1-Flash values (tables of 384M rows: never build those on a CPU)."""

    engram_layer_ids: tuple[int, ...] = (1, 14)
    """0-based layers with an Engram branch, strictly increasing (the prime walk follows it)."""
    engram_max_ngram_size: int = 4
    """N: orders 2..N are hashed."""
    engram_n_heads: int = 8
    """Hash heads (prime-sized tables) per order."""
    engram_head_dim: int = 256
    """Width of one table row; the memory of a position is (N-1) * heads rows wide."""
    engram_vocab_size: int = 16_000_000
    """Every order's heads take the next unused primes above this number."""
    engram_pad_token_id: int = 2
    """Raw token id whose compressed id fills blocked n-gram positions."""
    engram_compressed_vocab_size: int | None = None
    """Distinct compressed ids of the tokenizer (released: 99092); checked when set, since the
    hash multipliers depend on it."""
    engram_num_embeddings: tuple[int, ...] | None = None
    """Table rows per Engram layer; checked when set: each must equal the sum of the layer's
    primes (the released row counts do)."""
    hc_mult: int = 4
    """mHC residual streams: one key per stream, one shared value."""
    rms_norm_eps: float = 1e-20
    """Epsilon of the gate's two RMS norms."""
    initializer_range: float = 0.02
    """Std of the normal init of the tables and of `wkv`."""

    def __post_init__(self) -> None:
        layers = tuple(int(i) for i in self.engram_layer_ids)
        object.__setattr__(self, "engram_layer_ids", layers)
        if not layers or any(i < 0 for i in layers) or list(layers) != sorted(set(layers)):
            raise ConfigError(f"engram_layer_ids={list(layers)} must be non-empty, non-negative "
                             "and strictly increasing.")
        for name, low in (("engram_max_ngram_size", 2), ("engram_n_heads", 1),
                          ("engram_head_dim", 1), ("engram_vocab_size", 2), ("hc_mult", 1),
                          ("engram_pad_token_id", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}={value!r} must be an integer >= {low}.")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be finite and positive.")
        if self.engram_num_embeddings is not None:
            rows = tuple(int(n) for n in self.engram_num_embeddings)
            object.__setattr__(self, "engram_num_embeddings", rows)
            if len(rows) != len(layers):
                raise ConfigError(f"engram_num_embeddings has {len(rows)} entries, "
                                 f"engram_layer_ids {len(layers)}: give one row count per layer.")

    @property
    def num_hash_heads(self) -> int:
        """K = (N-1) * heads: hash ids per position and layer."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def paper_fields(self) -> SimpleNamespace:
        """The same hash in the paper variant's field names (what `NgramHashMapping` reads)."""
        return SimpleNamespace(
            engram_layer_ids=list(self.engram_layer_ids),
            max_ngram_size=self.engram_max_ngram_size,
            n_head_per_ngram=self.engram_n_heads,
            n_embed_per_ngram=self.engram_n_heads * self.engram_head_dim,
            engram_vocab_size=[self.engram_vocab_size] * (self.engram_max_ngram_size - 1),
            engram_pad_id=self.engram_pad_token_id,
            engram_seed=0,
            engram_reset_at_eos=False,
            engram_eos_id=None,
            engram_one_row_per_head=False,
            engram_hc_mult=self.hc_mult,
        )


def document_ids(input_ids: np.ndarray | torch.Tensor, eos_id: int) -> np.ndarray | torch.Tensor:
    """Document ids [B, T] of EOS-delimited packed rows: 1 + the number of EOS strictly before
    each position (an EOS ends its own document, as `ngram_hash.document_distance`). Zero is
    left for padding, as V4.1's ``sequence_ids``."""
    if isinstance(input_ids, torch.Tensor):
        is_eos = (input_ids == eos_id).long()
        return 1 + torch.cumsum(is_eos, dim=-1) - is_eos
    is_eos = (np.asarray(input_ids) == eos_id).astype(np.int64)
    return 1 + np.cumsum(is_eos, axis=-1) - is_eos


def live_run_length(
    batch: int, seq_len: int, token_mask: np.ndarray | None, sequence_ids: np.ndarray | None
) -> np.ndarray:
    """int64 [B, T]: how many positions ending at t (t included) are live and in t's document;
    0 where t itself is dead. The n-gram at t keeps the token k back iff k < this length."""
    live = np.ones((batch, seq_len), dtype=bool) if token_mask is None else token_mask.copy()
    same_as_previous = np.ones((batch, seq_len), dtype=bool)
    if sequence_ids is not None:
        live &= sequence_ids != 0  # document id 0 is padding
        same_as_previous[:, 1:] = sequence_ids[:, 1:] == sequence_ids[:, :-1]
    continues = np.zeros((batch, seq_len), dtype=bool)
    continues[:, 1:] = live[:, :-1] & same_as_previous[:, 1:]
    positions = np.arange(seq_len, dtype=np.int64)
    run_start = np.maximum.accumulate(np.where(continues, 0, positions), axis=1)
    return np.where(live, positions - run_start + 1, 0)


class DeepseekV41NgramHashMapping(NgramHashMapping):
    """`NgramHashMapping` with V4.1's fields and look-back rule (module docstring).

    ``hash``/``hash_stacked``/``hash_block`` take, beside the raw ids [B, T] (or [T]), the
    optional ``token_mask`` (bool, False: a dead token) and ``sequence_ids`` (int document ids,
    0: padding) of the same shape, numpy or torch. The values are head-local as in the paper
    variant (`table_rows` adds the head offsets). ``tokenizer``: a `CompressedTokenizer`, its
    lookup array, or the path of a ``tokenizer.json`` (or its folder). ``eos_id``: where no
    ``sequence_ids`` are given, documents end at this raw id (`document_ids`; the trainer's
    EOS-delimited rows with ``engram_reset_at_eos``); None: a row is one document.
    """

    def __init__(
        self,
        args: DeepseekV41EngramArgs,
        tokenizer: CompressedTokenizer | np.ndarray | str | os.PathLike,
        num_threads: int = 1,
        eos_id: int | None = None,
    ) -> None:
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = CompressedTokenizer(tokenizer)
        super().__init__(args.paper_fields(), tokenizer, num_threads=num_threads)
        self.args = args
        if eos_id is not None:
            if isinstance(eos_id, bool) or not 0 <= int(eos_id) < self.num_raw_ids:
                raise ConfigError(f"engram_eos_id={eos_id} must be a raw id in "
                                  f"[0, {self.num_raw_ids}) of this tokenizer.")
            self.eos_id = int(eos_id)
        expected = args.engram_compressed_vocab_size
        if expected is not None and expected != self.compressed_vocab_size:
            raise ConfigError(
                f"engram_compressed_vocab_size={expected}, but the tokenizer compresses to "
                f"{self.compressed_vocab_size} ids: the hash multipliers depend on it, so this "
                "is another tokenizer than the model's."
            )
        if args.engram_num_embeddings is not None:
            for layer, rows in zip(self.layer_ids, args.engram_num_embeddings):
                if rows != self.num_rows[layer]:
                    raise ConfigError(
                        f"engram_num_embeddings gives layer {layer} {rows} rows; its hash heads "
                        f"address exactly {self.num_rows[layer]} (the sum of its primes)."
                    )

    def shifted_ids(
        self,
        input_ids: np.ndarray,
        token_mask: np.ndarray | None = None,
        sequence_ids: np.ndarray | None = None,
    ) -> list[np.ndarray]:
        """`s_k[b, t] = c[b, t-k]` for k = 0..N-1 over compressed ids `c` where the n-gram at t
        may reach t-k (`live_run_length`), else the compressed pad id."""
        compressed = self.lookup[input_ids]
        batch, seq_len = compressed.shape
        lead = self.max_ngram_size - 1
        padded = np.full((batch, seq_len + lead), self.pad_id, dtype=np.int64)
        padded[:, lead:] = compressed
        reach = live_run_length(batch, seq_len, token_mask, sequence_ids)
        return [np.where(reach > k, padded[:, lead - k : lead - k + seq_len], self.pad_id)
                for k in range(self.max_ngram_size)]

    def hash(self, input_ids, token_mask=None, sequence_ids=None) -> dict:
        """`{layer_id: int64 [B, T, K]}` (views into one `hash_stacked` block)."""
        return dict(zip(self.layer_ids, self.hash_stacked(input_ids, token_mask, sequence_ids)))

    __call__ = hash

    def hash_stacked(self, input_ids, token_mask=None, sequence_ids=None):
        """All layers at once: int64 [L, B, T, K] (head-major storage, as the paper variant);
        numpy in gives numpy out, torch in gives torch out on the input's device."""
        as_numpy = not isinstance(input_ids, torch.Tensor)
        device = None if as_numpy else input_ids.device
        ids = _numpy(input_ids)
        if ids.ndim not in (1, 2):
            raise InputError(f"input_ids must be [B, T] or [T], got shape {tuple(ids.shape)}.")
        squeeze = ids.ndim == 1
        ids = ids.reshape(1, -1) if squeeze else ids
        check_raw_ids(ids, self.num_raw_ids)
        mask = _companion(token_mask, "token_mask", ids.shape, squeeze)
        if mask is not None and mask.dtype != np.bool_:
            raise InputTypeError(f"token_mask must be boolean, got dtype {mask.dtype}.")
        documents = _companion(sequence_ids, "sequence_ids", ids.shape, squeeze)
        if documents is not None and not np.issubdtype(documents.dtype, np.integer):
            raise InputTypeError(f"sequence_ids must be integer document ids, got {documents.dtype}.")
        if documents is None and self.eos_id is not None:
            documents = document_ids(ids, self.eos_id)
        shifts = self.shifted_ids(ids.astype(np.int64, copy=False), mask, documents)
        stacked = self._stack_layers(shifts)
        if squeeze:
            stacked = stacked[:, 0]
        return stacked if as_numpy else torch.from_numpy(stacked).to(device)

    def hash_block(self, input_ids, token_mask=None, sequence_ids=None):
        """What the model takes for a micro-batch [B, T]: `hash_stacked`'s [L, B, T, K] block
        (no conv: no document-distance slice), and with a ``token_mask`` one more slice (index
        L) holding it as 0/1 in each of its K columns: the Engram layers read it to add nothing
        at dead positions (`with_token_mask`)."""
        block = self.hash_stacked(input_ids, token_mask, sequence_ids)
        return block if token_mask is None else with_token_mask(block, token_mask)


def with_token_mask(block, token_mask):
    """``block`` [L, B, T, K] (numpy or torch) plus the mask slice: ``token_mask`` [B, T] (or
    [T]), True where a token is live, as int64 in each of the K columns of slice L."""
    if isinstance(block, torch.Tensor):
        mask = torch.as_tensor(token_mask).to(device=block.device, dtype=torch.int64)
        extra = mask.reshape(1, *block.shape[1:-1], 1).expand(1, *block.shape[1:])
        return torch.cat([block, extra])
    mask = _numpy(token_mask).astype(np.int64).reshape(1, *block.shape[1:-1], 1)
    return np.concatenate([block, np.broadcast_to(mask, (1, *block.shape[1:]))])


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _companion(x, name: str, shape: tuple[int, ...], squeeze: bool) -> np.ndarray | None:
    """A [B, T] (or [T]) per-token input beside the ids, as numpy [B, T]."""
    if x is None:
        return None
    arr = _numpy(x)
    arr = arr.reshape(1, -1) if squeeze and arr.ndim == 1 else arr
    if arr.shape != shape:
        raise InputError(f"{name} shape {tuple(arr.shape)} must equal input_ids' {shape}.")
    return arr
