"""N-gram hashing for decoding: each new token is hashed from the last N-1 compressed ids.

The hash of position t reads tokens t-N+1..t only, so a sequence's *history* (its last N-1
compressed ids, the pad id where the sequence is shorter or, with EOS reset, where the current
document is) is all the state decoding needs: one token costs O(N + K) integer operations per
layer, whatever the sequence length. Constants come from the export (exact int64 tensors), so
addresses equal the trainer's `NgramHashMapping` on the full sequence, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from engram_train.errors import InputError, InputTypeError


class IncrementalNgramHasher:
    """Hashes the newest tokens of a batch of sequences, given and updating their histories.

    `lookup` maps raw ids to compressed ids (int64 [V]); `multipliers[layer]` (int64 [N]) and
    `primes[layer]` (int64 [(N-1)*H], 2-gram heads first) are the export's constants;
    `pad_id` is the *compressed* pad id; `eos_id` (raw) turns on the reset at EOS.
    """

    def __init__(
        self,
        lookup: np.ndarray,
        multipliers: Mapping[int, np.ndarray],
        primes: Mapping[int, np.ndarray],
        max_ngram_size: int,
        n_head_per_ngram: int,
        pad_id: int,
        eos_id: int | None = None,
    ) -> None:
        self.lookup = np.ascontiguousarray(lookup, dtype=np.int64)
        self.num_raw_ids = int(self.lookup.shape[0])
        self.layer_ids = [int(layer) for layer in multipliers]
        self.max_ngram_size = int(max_ngram_size)
        self.n_head_per_ngram = int(n_head_per_ngram)
        self.num_heads = (self.max_ngram_size - 1) * self.n_head_per_ngram
        self.multipliers = {int(k): np.asarray(v, dtype=np.int64) for k, v in multipliers.items()}
        self.primes = {int(k): np.asarray(v, dtype=np.int64) for k, v in primes.items()}
        for layer in self.layer_ids:
            if self.multipliers[layer].shape != (self.max_ngram_size,):
                raise InputError(f"layer {layer}: {self.multipliers[layer].shape[0]} multipliers "
                                 f"for max_ngram_size={self.max_ngram_size}")
            if self.primes[layer].shape != (self.num_heads,):
                raise InputError(f"layer {layer}: {self.primes[layer].shape[0]} primes for "
                                 f"{self.num_heads} heads")
        self.pad_id = int(pad_id)
        self.eos_id = None if eos_id is None else int(eos_id)

    @property
    def history_length(self) -> int:
        return self.max_ngram_size - 1

    def new_history(self, batch_size: int) -> np.ndarray:
        """Histories of `batch_size` empty sequences: int64 [B, N-1], oldest first, all pad."""
        return np.full((batch_size, self.history_length), self.pad_id, dtype=np.int64)

    def extend(self, history: np.ndarray, token_ids: np.ndarray | Sequence) -> np.ndarray:
        """Hash `token_ids` [B, T] (raw ids) that follow `history` [B, N-1], which is updated in
        place. Returns head-local hashes, int64 [L, B, T, K] in `layer_ids` order."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or history.ndim != 2 or ids.shape[0] != history.shape[0]:
            raise InputError(f"token_ids must be [B, T] for B={history.shape[0]} sequences, got "
                             f"shape {tuple(ids.shape)}")
        check_prompt_ids(ids, self.num_raw_ids)
        ids = ids.astype(np.int64, copy=False)
        batch, seq = ids.shape
        if seq == 0:  # nothing new: the history stays as it is
            return np.empty((len(self.layer_ids), batch, 0, self.num_heads), dtype=np.int64)
        lead = self.history_length
        window = np.concatenate([history, self.lookup[ids]], axis=1)  # [B, lead + T]
        shifts = [window[:, lead - k: lead - k + seq] for k in range(self.max_ngram_size)]
        doc_start = None
        if self.eos_id is not None:
            # Window index where each position's document starts; 0 = the history counts (it is
            # already pad before the current document). A document starts after an EOS.
            starts = np.where(ids == self.eos_id, lead + np.arange(seq) + 1, 0)
            after = np.maximum.accumulate(starts, axis=1)
            doc_start = np.zeros_like(after)
            doc_start[:, 1:] = after[:, :-1]
            position = lead + np.arange(seq)
            shifts = [s if k == 0 else np.where(position - k >= doc_start, s, self.pad_id)
                      for k, s in enumerate(shifts)]

        out = np.empty((len(self.layer_ids), batch, seq, self.num_heads), dtype=np.int64)
        for index, layer in enumerate(self.layer_ids):
            m, primes = self.multipliers[layer], self.primes[layer]
            mix = shifts[0] * m[0]
            for k in range(1, self.max_ngram_size):  # mix of order n = k + 1
                mix = np.bitwise_xor(mix, shifts[k] * m[k])
                heads = slice((k - 1) * self.n_head_per_ngram, k * self.n_head_per_ngram)
                np.remainder(mix[..., None], primes[heads], out=out[index, :, :, heads])

        history[:] = window[:, -lead:]
        if doc_start is not None:  # the last document began inside the new tokens
            last_start = after[:, -1:]
            kept = np.arange(seq, seq + lead)[None, :] >= last_start
            history[:] = np.where(kept, history, self.pad_id)
        return out


def check_prompt_ids(ids: np.ndarray, num_raw_ids: int) -> None:
    """Raise naming the expected dtype (integers) or the first id outside [0, num_raw_ids)."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputTypeError(f"token ids must be integers (torch.int64 / numpy.int64, or nested lists of "
                        f"ints), got dtype {ids.dtype}")
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < num_raw_ids:
        return
    bad = lo if lo < 0 else hi
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(ids == bad)), ids.shape))
    raise InputError(
        f"token id {bad} at [sequence, position] {list(index)} of the prompt is outside the "
        f"export's tokenizer range [0, {num_raw_ids}): the prompt was tokenized with another "
        "tokenizer. Tokenize prompts with the export's tokenizer.json "
        "(EngramMemory.check_tokenizer compares a tokenizer file with it)"
    )


def continue_document_distance(ids: np.ndarray, eos_id: int, since: np.ndarray
                               ) -> tuple[np.ndarray, np.ndarray]:
    """Document distances (position minus its document's start) of new raw ids [B, T] that
    follow sequences whose next token lies ``since`` [B] tokens after its document's start (0
    for a new sequence or after an EOS); returns (distances int64 [B, T], the new ``since``).
    Equals ``engram.ngram_hash.document_distance`` of the whole sequence: a document starts
    right after an EOS. The short conv stops its look-back there (``engram_reset_at_eos``)."""
    ids = np.asarray(ids)
    since = np.asarray(since, dtype=np.int64)
    batch, seq = ids.shape
    if seq == 0:
        return np.empty((batch, 0), dtype=np.int64), since.copy()
    position = np.arange(seq, dtype=np.int64)
    after = np.maximum.accumulate(np.where(ids == eos_id, position + 1, 0), axis=1)
    before = np.zeros_like(after)
    before[:, 1:] = after[:, :-1]  # the latest start strictly before t (0: none in ids)
    distance = np.where(before > 0, position - before, since[:, None] + position)
    last = after[:, -1]
    return distance, np.where(last > 0, seq - last, since + seq)
