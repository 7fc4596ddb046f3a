"""Micro-batches for data-parallel training, and Engram hashing one micro-batch ahead.

Sample order is megatron's ``MegatronPretrainingSampler`` order, so ``consumed_samples`` means
the same thing here as in a Megatron-LM checkpoint. With global batch size G, micro-batch size
m, data-parallel size d and ``n = G // (m * d)`` micro-batches per rank per step, micro-batch k
(0 <= k < n) of global batch i on data-parallel rank r holds the dataset samples::

    i * G + k * (m * d) + r * m  +  [0, m)

so global batch i is the G consecutive samples ``[i * G, (i + 1) * G)``, spread over the ranks,
and the union over ranks and micro-batches equals what a single rank with ``m * d``-sample
micro-batches would see. Resuming from ``consumed_samples`` continues the exact same sequence.

Batch layout (a dict of CPU tensors, B = micro_batch_size, S = seq_length):

- ``tokens``        int64   [B, S]  input ids
- ``labels``        int64   [B, S]  ``tokens`` shifted left by one (next-token targets)
- ``loss_mask``     float32 [B, S]  1.0 where the label counts in the loss
- ``position_ids``  int64   [B, S]
- ``attention_mask`` bool   [B, 1, S, S]  only when the datasets were built with
  ``create_attention_mask=True`` (True = masked out)
- ``dataset_id``    int16   [B]     only for a blend of several prefixes: which one
- ``engram_hash_ids`` int64 [L, B, S, K]   added by `HashPrefetchIterator` (one block for the
  L Engram layers, as ``NgramHashMapping.hash_stacked`` returns it)
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engram_train.errors import InputError

HASH_KEY = "engram_hash_ids"


def collate(samples: list[Mapping[str, object]]) -> dict[str, torch.Tensor]:
    """Stack per-sample values (tensors, numpy arrays or scalars) along a new leading dim."""
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}


class MicroBatchIterator:
    """This data-parallel rank's micro-batches of `dataset`, resumable from ``consumed_samples``.

    Args:
        dataset: anything indexable by int with a length whose items are dicts of tensors (a
            megatron ``GPTDataset`` or ``BlendedDataset``).
        global_batch_size: samples per optimizer step over all data-parallel ranks (G).
        micro_batch_size: samples per forward/backward on one rank (m).
        dp_rank, dp_size: this rank's data-parallel rank and the data-parallel size (r, d).
        consumed_samples: samples (over all ranks) already consumed, e.g. from a checkpoint;
            a multiple of ``micro_batch_size * dp_size``.

    Iteration stops before a global batch the dataset cannot fill; ``consumed_samples`` is
    advanced by ``m * d`` per micro-batch yielded.
    """

    def __init__(
        self,
        dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
    ) -> None:
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("data-parallel size", dp_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise InputError(f"{name} must be a positive integer, got {value!r}.")
        if global_batch_size % (micro_batch_size * dp_size):
            raise InputError(
                f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
                f"({micro_batch_size}) x data-parallel size ({dp_size}) = "
                f"{micro_batch_size * dp_size}."
            )
        if not 0 <= dp_rank < dp_size:
            raise InputError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}.")
        step = micro_batch_size * dp_size
        if consumed_samples < 0 or consumed_samples % step:
            raise InputError(
                f"consumed_samples ({consumed_samples}) must be a non-negative multiple of "
                f"micro_batch_size x data-parallel size ({step})."
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.consumed_samples = consumed_samples
        self.num_microbatches = global_batch_size // step
        self.total_samples = len(dataset) // global_batch_size * global_batch_size
        """Samples usable in whole global batches."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step = self.micro_batch_size * self.dp_size
        if self.consumed_samples + step > self.total_samples:
            raise StopIteration
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        batch = collate([self.dataset[i] for i in range(start, start + self.micro_batch_size)])
        self.consumed_samples += step
        return batch

    def __len__(self) -> int:
        """Micro-batches left for this rank."""
        step = self.micro_batch_size * self.dp_size
        return max(0, self.total_samples - self.consumed_samples) // step

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


_END = object()


class HashPrefetchIterator:
    """Adds ``batch["engram_hash_ids"] = hash_fn(batch["tokens"])`` to every micro-batch.

    With ``prefetch=True`` a background CPU thread reads and hashes up to ``depth`` micro-batches
    ahead of the consumer (the trainer asks for a whole step's micro-batches ahead, so the next
    step's hashing runs while this step computes). A batch is handed out only once its hash is
    complete; order is preserved; an exception raised by `batches` or `hash_fn` in the thread is
    re-raised by the ``next()`` that would have returned that batch, after which the iterator is
    closed. ``prefetch=False`` does the same work inline in ``next()``.

    `hash_fn` gets the CPU ``tokens`` tensor (int64 [B, S]) and returns the ``[L, B, S, K]``
    block (a tensor or numpy array, wrapped without a copy; ``NgramHashMapping.hash_stacked``).
    A ``{layer_id: [B, S, K]}`` mapping is stacked in its own order (give it in
    ``engram_layer_ids`` order).

    Because of the read-ahead, the wrapped iterator's own ``consumed_samples`` runs ahead of the
    consumer: checkpoint the trainer's count, not the iterator's. ``wait_s`` accumulates the
    time ``next()`` spent waiting for a hash (the part of hashing that was not hidden).

    Use as a context manager, or call `close()`, to stop the thread.
    """

    def __init__(
        self,
        batches: Iterable[dict],
        hash_fn: Callable[[torch.Tensor], object],
        prefetch: bool = True,
        depth: int = 1,
    ) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise InputError(f"depth must be a positive int (micro-batches hashed ahead), got {depth!r}")
        self._batches = iter(batches)
        self._hash_fn = hash_fn
        self.prefetch = prefetch
        self.depth = depth
        self.wait_s = 0.0
        self.hash_s = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: collections.deque[Future] = collections.deque()
        if prefetch:
            # One worker: the wrapped iterator is read in order, one batch at a time.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-hash")
            for _ in range(depth):
                self._pending.append(self._executor.submit(self._produce))

    def _produce(self):
        try:
            batch = next(self._batches)
        except StopIteration:
            return _END
        batch = dict(batch)
        start = time.perf_counter()
        ids = self._hash_fn(batch["tokens"])
        if isinstance(ids, Mapping):
            ids = torch.stack([torch.as_tensor(v) for v in ids.values()])
        batch[HASH_KEY] = torch.as_tensor(ids)
        self.hash_s += time.perf_counter() - start
        return batch

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        with self._lock:
            if self._closed:
                raise StopIteration
            try:
                if self._executor is None:
                    item = self._produce()
                else:
                    start = time.perf_counter()
                    item = self._pending.popleft().result()
                    self.wait_s += time.perf_counter() - start
                    if item is not _END:
                        self._pending.append(self._executor.submit(self._produce))
            except BaseException:
                self._close_locked()
                raise
            if item is _END:
                self._close_locked()
                raise StopIteration
            return item

    def close(self) -> None:
        """Stop the background thread (waits for a hash in progress); idempotent."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
            self._pending.clear()

    def __enter__(self) -> HashPrefetchIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
