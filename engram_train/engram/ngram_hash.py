"""N-gram hashing: compressed token ids -> per-head table indices (spec section 2).

Addresses depend on token ids only, never on activations, so hashing runs on the CPU next
to the data loader, once per micro-batch for all Engram layers, and the int64 ids travel
with the batch. Results are bit-exact with DeepSeek's reference `NgramHashMapping.hash`:
numpy PCG64 multipliers, one global prime walk, XOR of int64 products, floor modulo.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

import numpy as np
import torch

from engram_train.errors import ConfigError, InputError
from engram_train.engram.compressed_tokenizer import CompressedTokenizer, check_raw_ids

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
    one_row: bool = False,
) -> dict[int, list[list[int]]]:
    """Prime table size of every head: `{layer: [order n-2][head]}`.

    One `seen` set spans all layers (in `layer_ids` order), orders and heads, so no two heads
    anywhere share a modulus. The walk depends on the whole layer list: a layer's primes
    change if another Engram layer is added before it. `one_row` (the
    `engram_one_row_per_head` control): every head gets a single row (modulus 1).
    """
    if one_row:
        heads = [1] * int(n_head_per_ngram)
        return {int(i): [list(heads) for _ in range(max_ngram_size - 1)] for i in layer_ids}
    # one entry of engram_vocab_size per order: validated with the config (EngramConfig)
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
    values are head-local (in [0, prime)) and stored head-major (see `hash_stacked`).
    `table_rows` adds the per-head offsets.
    Numpy in gives numpy out; torch in gives torch out on the input's device. The work runs on
    the CPU; `num_threads` > 1 hashes layers concurrently (numpy releases the GIL), while the
    default of 1 suits a data-loader worker.
    """

    def __init__(
        self,
        config,
        tokenizer: CompressedTokenizer | np.ndarray | None = None,
        num_threads: int = 1,
    ) -> None:
        if num_threads < 1:
            raise InputError(f"num_threads={num_threads} must be >= 1.")
        self.num_threads = int(num_threads)
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
            raise ConfigError(
                f"engram_pad_id={raw_pad} is outside the tokenizer's range [0, {self.num_raw_ids}):"
                " set it to a raw id of this tokenizer."
            )
        self.raw_pad_id = raw_pad
        self.pad_id = int(lookup[raw_pad])  # compressed
        self.eos_id = None
        if config.engram_reset_at_eos:
            eos = config.engram_eos_id
            if eos is None or not 0 <= int(eos) < self.num_raw_ids:
                raise ConfigError(
                    f"engram_eos_id={eos} must be a raw id in [0, {self.num_raw_ids}) when "
                    "engram_reset_at_eos=True."
                )
            self.eos_id = int(eos)

        self.multipliers = layer_multipliers(
            self.layer_ids, self.max_ngram_size, self.compressed_vocab_size, config.engram_seed
        )
        self.head_vocab_sizes = engram_head_vocab_sizes(
            config.engram_vocab_size, self.max_ngram_size, self.n_head_per_ngram, self.layer_ids,
            one_row=config.engram_one_row_per_head,
        )
        self.primes = {
            layer: np.array([p for heads in orders for p in heads], dtype=np.int64)
            for layer, orders in self.head_vocab_sizes.items()
        }
        self.offsets = {layer: head_offsets(p) for layer, p in self.primes.items()}
        self.num_rows = {layer: int(p.sum()) for layer, p in self.primes.items()}
        self._local, self._pool, self._pool_pid = threading.local(), None, None

    def _scratch(self, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        # Reused per thread: fresh buffers on every call cost page faults.
        size = batch * seq_len
        flat = getattr(self._local, "scratch", None)
        if flat is None or flat.size < 2 * size:
            flat = np.empty(2 * size, dtype=np.int64)
            self._local.scratch = flat
        return flat[:size].reshape(batch, seq_len), flat[size : 2 * size].reshape(batch, seq_len)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # threads do not survive fork
            self._pool = ThreadPoolExecutor(self.num_threads - 1, "engram-hash")
            self._pool_pid = os.getpid()
        return self._pool

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_local", "_pool", "_pool_pid"):  # per process / per thread
            del state[name]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local, self._pool, self._pool_pid = threading.local(), None, None

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
        """`{layer_id: int64 [B, T, (N-1)*H]}` for raw ids [B, T] (or [T] -> [T, (N-1)*H]).

        The values are views into one `hash_stacked` block (head-major storage, see there)."""
        return dict(zip(self.layer_ids, self.hash_stacked(input_ids)))

    def hash_stacked(self, input_ids: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """All layers at once: int64 [L, B, T, (N-1)*H], L in `layer_ids` order.

        Stored head-major ([L, K, B, T] in memory; the result is a permuted view): each head's
        floor mod writes one contiguous block, and no CPU transpose is spent on a layout that
        the table lookup does not need. Use `np.ascontiguousarray` / `.contiguous()` if C order
        matters. One block also means one allocation and one host-to-device copy.
        """
        as_numpy = not isinstance(input_ids, torch.Tensor)
        device = None if as_numpy else input_ids.device
        ids = np.asarray(input_ids) if as_numpy else input_ids.detach().cpu().numpy()
        if ids.ndim not in (1, 2):
            raise InputError(f"input_ids must be [B, T] or [T], got shape {tuple(ids.shape)}.")
        squeeze = ids.ndim == 1
        ids = ids.reshape(1, -1) if squeeze else ids
        check_raw_ids(ids, self.num_raw_ids)
        stacked = self._stack_layers(self.shifted_ids(ids.astype(np.int64, copy=False)))
        if squeeze:
            stacked = stacked[:, 0]
        return stacked if as_numpy else torch.from_numpy(stacked).to(device)

    def _stack_layers(self, shifts: list[np.ndarray]) -> np.ndarray:
        """Every layer's hashes of the shifted ids [B, T]: the [L, B, T, K] view of head-major
        storage that `hash_stacked` returns (shared with the DeepSeek-V4.1 variant)."""
        batch, seq_len = shifts[0].shape
        storage = np.empty((len(self.layer_ids), self.num_heads, batch, seq_len), dtype=np.int64)

        def hash_layers(indices: range) -> None:
            for index in indices:
                self._layer_hash(shifts, self.layer_ids[index], storage[index])

        # Layers are independent once the shifted ids exist: deal them out to the threads.
        groups = [range(i, len(self.layer_ids), self.num_threads) for i in range(self.num_threads)]
        futures = [self._executor().submit(hash_layers, g) for g in groups[1:] if len(g)]
        hash_layers(groups[0])
        for future in futures:
            future.result()
        return storage.transpose(0, 2, 3, 1)

    def hash_block(self, input_ids: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """What the model takes for a micro-batch [B, T]: `hash_stacked`'s [L, B, T, K] block,
        and with ``engram_reset_at_eos`` one more slice (index L) holding every position's
        `document_distance` in each of its K columns: the Engram short conv reads it to stop
        its look-back at the document start. Computed on the whole sequence, so it splits with
        the ids under context parallelism."""
        block = self.hash_stacked(input_ids)
        if self.eos_id is None:
            return block
        ids = np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor) else (
            input_ids.detach().cpu().numpy())
        distance = document_distance(ids.reshape(-1, ids.shape[-1]).astype(np.int64, copy=False),
                                     self.eos_id).reshape(ids.shape)
        if isinstance(block, torch.Tensor):
            extra = torch.from_numpy(distance).to(block.device)[None, ..., None]
            return torch.cat([block, extra.expand(1, *block.shape[1:])])
        extra = np.broadcast_to(distance[None, ..., None], (1, *block.shape[1:]))
        return np.concatenate([block, extra])

    def _layer_hash(self, shifts: list[np.ndarray], layer_id: int, out: np.ndarray) -> None:
        """Hashes of one layer into head-major `out` [K, B, T]."""
        # Floor mod as x - (x // p) * p, one head at a time: numpy divides by a scalar with
        # libdivide, several times faster than `%` (which issues a hardware division per item).
        # Where q * p wraps around int64, the subtraction wraps back: the remainder is exact.
        heads = self.n_head_per_ngram
        m = self.multipliers[layer_id]
        primes = self.primes[layer_id].tolist()
        mix, product = self._scratch(*shifts[0].shape)
        np.multiply(shifts[0], m[0], out=mix)
        for k in range(1, self.max_ngram_size):  # mix of order n = k + 1, built incrementally
            np.multiply(shifts[k], m[k], out=product)
            np.bitwise_xor(mix, product, out=mix)
            for j in range((k - 1) * heads, k * heads):
                rem = out[j]
                np.floor_divide(mix, primes[j], out=rem)
                np.multiply(rem, primes[j], out=rem)
                np.subtract(mix, rem, out=rem)

    __call__ = hash

    def table_rows(
        self, layer_id: int, hash_ids: np.ndarray | torch.Tensor
    ) -> np.ndarray | torch.Tensor:
        """Head-local hashes [..., K] -> rows of the layer's concatenated table."""
        offsets = self.offsets[layer_id]
        if isinstance(hash_ids, torch.Tensor):
            return hash_ids + torch.from_numpy(offsets).to(hash_ids.device)
        return hash_ids + offsets
