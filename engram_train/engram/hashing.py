"""N-gram hashing: compressed token ids -> per-head table indices (spec section 2).

Addresses depend on token ids only, never on activations, so hashing runs on the CPU next
to the data loader, once per micro-batch for all Engram layers, and the int64 ids travel
with the batch. Results are bit-exact with DeepSeek's reference `NgramHashMapping.hash`:
numpy PCG64 multipliers, one global prime walk, XOR of int64 products, floor modulo.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from engram_train.engram.tokenizer import CompressedTokenizer, check_raw_ids

_INT64_MAX = np.iinfo(np.int64).max
_LAYER_SEED_STRIDE = 10007  # the reference's PRIME_1: seed of layer L is seed + 10007 * L
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; exact for every n < 3.3e24 (so every int64)."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_unseen_prime(start: int, seen: set[int]) -> int:
    """Smallest prime > start that is not in `seen`."""
    candidate = start + 1
    while candidate in seen or not is_prime(candidate):
        candidate += 1
    return candidate


@functools.lru_cache(maxsize=64)
def _head_vocab_sizes(
    engram_vocab_size: tuple[int, ...],
    max_ngram_size: int,
    n_head_per_ngram: int,
    layer_ids: tuple[int, ...],
) -> dict[int, tuple[tuple[int, ...], ...]]:
    seen: set[int] = set()
    sizes: dict[int, tuple[tuple[int, ...], ...]] = {}
    for layer_id in layer_ids:
        per_order = []
        for n in range(2, max_ngram_size + 1):
            p = engram_vocab_size[n - 2] - 1
            heads = []
            for _ in range(n_head_per_ngram):
                p = next_unseen_prime(p, seen)
                seen.add(p)
                heads.append(p)
            per_order.append(tuple(heads))
        sizes[layer_id] = tuple(per_order)
    return sizes


def engram_head_vocab_sizes(
    engram_vocab_size: Sequence[int],
    max_ngram_size: int,
    n_head_per_ngram: int,
    layer_ids: Sequence[int],
) -> dict[int, list[list[int]]]:
    """Prime table size of every head: `{layer: [order n-2][head]}`.

    One `seen` set spans all layers (in `layer_ids` order), orders and heads, so no two heads
    anywhere share a modulus. The walk depends on the whole layer list: a layer's primes
    change if another Engram layer is added before it.
    """
    if len(engram_vocab_size) != max_ngram_size - 1:
        raise ValueError(
            f"engram_vocab_size has {len(engram_vocab_size)} entries; max_ngram_size="
            f"{max_ngram_size} needs {max_ngram_size - 1}."
        )
    sizes = _head_vocab_sizes(
        tuple(int(v) for v in engram_vocab_size),
        int(max_ngram_size),
        int(n_head_per_ngram),
        tuple(int(i) for i in layer_ids),
    )
    return {layer: [list(heads) for heads in orders] for layer, orders in sizes.items()}


def layer_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int, seed: int
) -> dict[int, np.ndarray]:
    """Odd int64 multipliers per layer, one per n-gram position (numpy PCG64, as the reference).

    Bounded by `half = (int64_max // V') // 2` so that id * multiplier never overflows int64.
    """
    half = max(1, (_INT64_MAX // int(compressed_vocab_size)) // 2)
    out = {}
    for layer_id in layer_ids:
        rng = np.random.default_rng(int(seed + _LAYER_SEED_STRIDE * int(layer_id)))
        out[int(layer_id)] = rng.integers(0, half, size=max_ngram_size, dtype=np.int64) * 2 + 1
    return out


def head_offsets(primes: Sequence[int]) -> np.ndarray:
    """Exclusive prefix sum of a layer's flattened head sizes: hash + offset = table row."""
    primes = np.asarray(primes, dtype=np.int64)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(primes)[:-1]]).astype(np.int64)


def document_distance(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """For [B, T] raw ids: t minus the start of t's document (int64 [B, T]).

    A document starts right after an EOS (the EOS ends its own document), so the n-gram at t
    may look back `k` tokens only if `k <= distance[b, t]`; older tokens count as padding.
    """
    seq_len = input_ids.shape[1]
    positions = np.arange(seq_len, dtype=np.int64)
    starts_after = np.where(input_ids == eos_id, positions + 1, 0)
    last_start = np.maximum.accumulate(starts_after, axis=1)
    doc_start = np.zeros_like(last_start)
    doc_start[:, 1:] = last_start[:, :-1]  # only an EOS strictly before t starts t's document
    return positions - doc_start


class NgramHashMapping:
    """Hashes raw token ids of a micro-batch for every Engram layer at once.

    `hash(input_ids [B, T])` -> `{layer_id: int64 [B, T, (N-1)*H]}`, 2-gram heads first; the
    values are head-local (in [0, prime)). `table_rows` adds the per-head offsets.
    Numpy in gives numpy out; torch in gives torch out on the input's device (the work is done
    on the CPU, mostly single-threaded, so it fits a data-loader worker).
    """

    def __init__(self, config, tokenizer: CompressedTokenizer | np.ndarray | None = None) -> None:
        if tokenizer is None:
            tokenizer = CompressedTokenizer(config.engram_tokenizer_name_or_path)
        lookup = tokenizer.lookup if isinstance(tokenizer, CompressedTokenizer) else tokenizer
        lookup = np.ascontiguousarray(lookup, dtype=np.int64)
        self.lookup = lookup
        self.num_raw_ids = int(lookup.shape[0])
        self.compressed_vocab_size = int(lookup.max()) + 1

        self.layer_ids = [int(i) for i in config.engram_layer_ids]
        self.max_ngram_size = int(config.max_ngram_size)
        self.n_head_per_ngram = int(config.n_head_per_ngram)
        self.num_heads = (self.max_ngram_size - 1) * self.n_head_per_ngram

        raw_pad = int(config.engram_pad_id)
        if not 0 <= raw_pad < self.num_raw_ids:
            raise ValueError(
                f"engram_pad_id={raw_pad} is outside the tokenizer's range [0, {self.num_raw_ids}):"
                " set it to a raw id of this tokenizer."
            )
        self.raw_pad_id = raw_pad
        self.pad_id = int(lookup[raw_pad])  # compressed
        self.eos_id = None
        if config.engram_reset_at_eos:
            eos = config.engram_eos_id
            if eos is None or not 0 <= int(eos) < self.num_raw_ids:
                raise ValueError(
                    f"engram_eos_id={eos} must be a raw id in [0, {self.num_raw_ids}) when "
                    "engram_reset_at_eos=True."
                )
            self.eos_id = int(eos)

        self.multipliers = layer_multipliers(
            self.layer_ids, self.max_ngram_size, self.compressed_vocab_size, config.engram_seed
        )
        self.head_vocab_sizes = engram_head_vocab_sizes(
            config.engram_vocab_size, self.max_ngram_size, self.n_head_per_ngram, self.layer_ids
        )
        self.primes = {
            layer: np.array([p for heads in orders for p in heads], dtype=np.int64)
            for layer, orders in self.head_vocab_sizes.items()
        }
        self.offsets = {layer: head_offsets(p) for layer, p in self.primes.items()}
        self.num_rows = {layer: int(p.sum()) for layer, p in self.primes.items()}
        self._primes_t = {
            layer: torch.from_numpy(p.reshape(self.max_ngram_size - 1, self.n_head_per_ngram))
            for layer, p in self.primes.items()
        }

    def shifted_ids(self, input_ids: np.ndarray) -> list[np.ndarray]:
        """`s_k[b, t] = c[b, t-k]` for k = 0..N-1 over compressed ids `c`, with the compressed
        pad where t-k falls before the row (or, with EOS reset, into an earlier document).
        Computed once and shared by every layer."""
        compressed = self.lookup[input_ids]
        batch, seq_len = compressed.shape
        lead = self.max_ngram_size - 1
        padded = np.full((batch, seq_len + lead), self.pad_id, dtype=np.int64)
        padded[:, lead:] = compressed
        shifts = [padded[:, lead - k : lead - k + seq_len] for k in range(self.max_ngram_size)]
        if self.eos_id is not None:
            distance = document_distance(input_ids, self.eos_id)
            shifts = [s if k == 0 else np.where(distance >= k, s, self.pad_id)
                      for k, s in enumerate(shifts)]
        return shifts

    def hash(self, input_ids: np.ndarray | torch.Tensor) -> dict[int, np.ndarray | torch.Tensor]:
        """`{layer_id: int64 [B, T, (N-1)*H]}` for raw ids [B, T] (or [T] -> [T, (N-1)*H])."""
        as_numpy = not isinstance(input_ids, torch.Tensor)
        device = None if as_numpy else input_ids.device
        ids = np.asarray(input_ids) if as_numpy else input_ids.detach().cpu().numpy()
        if ids.ndim not in (1, 2):
            raise ValueError(f"input_ids must be [B, T] or [T], got shape {tuple(ids.shape)}.")
        squeeze = ids.ndim == 1
        ids = ids.reshape(1, -1) if squeeze else ids
        check_raw_ids(ids, self.num_raw_ids)
        shifts = self.shifted_ids(ids.astype(np.int64, copy=False))
        out: dict[int, np.ndarray | torch.Tensor] = {}
        for layer_id in self.layer_ids:
            hashes = self._layer_hash(shifts, layer_id)
            if squeeze:
                hashes = hashes[0]
            out[layer_id] = hashes.numpy() if as_numpy else hashes.to(device)
        return out

    def _layer_hash(self, shifts: list[np.ndarray], layer_id: int) -> torch.Tensor:
        # Floor mod as x - (x // p) * p: numpy divides by a scalar with libdivide (several
        # times faster than `%`); head-major quotients, then one strided pass writes [B, T, K].
        batch, seq_len = shifts[0].shape
        orders, heads = self.max_ngram_size - 1, self.n_head_per_ngram
        m = self.multipliers[layer_id]
        primes = self.primes[layer_id]
        mixes = np.empty((orders, batch, seq_len), dtype=np.int64)
        product = np.empty((batch, seq_len), dtype=np.int64)
        mix = np.multiply(shifts[0], m[0])
        for k in range(1, self.max_ngram_size):  # XOR mix of order k+1, built incrementally
            np.multiply(shifts[k], m[k], out=product)
            mix = np.bitwise_xor(mix, product, out=mixes[k - 1])
        quotients = np.empty((orders, heads, batch, seq_len), dtype=np.int64)
        for order in range(orders):
            for head in range(heads):
                p = int(primes[order * heads + head])
                np.floor_divide(mixes[order], p, out=quotients[order, head])
        hashes = torch.empty((batch, seq_len, orders, heads), dtype=torch.int64)
        torch.addcmul(
            torch.from_numpy(mixes).permute(1, 2, 0).unsqueeze(-1),
            torch.from_numpy(quotients).permute(2, 3, 0, 1),
            self._primes_t[layer_id],
            value=-1,
            out=hashes,
        )
        return hashes.view(batch, seq_len, orders * heads)

    __call__ = hash

    def table_rows(
        self, layer_id: int, hash_ids: np.ndarray | torch.Tensor
    ) -> np.ndarray | torch.Tensor:
        """Head-local hashes [..., K] -> rows of the layer's concatenated table."""
        offsets = self.offsets[layer_id]
        if isinstance(hash_ids, torch.Tensor):
            return hash_ids + torch.from_numpy(offsets).to(hash_ids.device)
        return hash_ids + offsets
