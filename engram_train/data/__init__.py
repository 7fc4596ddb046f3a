"""Training data: tokenizer adapter, preprocessing, megatron GPT datasets, micro-batches.

- `text_tokenizer`: `HFTokenizer`, megatron's tokenizer interface over a local ``tokenizer.json``.
- `preprocess`: the ``engram-preprocess`` CLI, documents -> megatron ``.bin/.idx``.
- `datasets`: `build_gpt_datasets`, train/valid/test ``GPTDataset``s from a blend of prefixes
  (`DatasetError`: a dataset that cannot be trained on, named with the fix).
- `batches`: `MicroBatchIterator` (data-parallel split, resumable) and `HashPrefetchIterator`
  (Engram hash ids computed one micro-batch ahead on a CPU thread).

Names are imported lazily: importing megatron-core takes seconds, and ``engram-preprocess
--help`` should not.
"""

from __future__ import annotations

from engram_train.lazy_exports import lazy_getattr

_EXPORTS = {
    "HFTokenizer": "text_tokenizer",
    "TokenizerNotFoundError": "text_tokenizer",
    "load_tokenizer": "text_tokenizer",
    "build_gpt_datasets": "datasets",
    "DatasetError": "datasets",
    "DatasetNotFoundError": "datasets",
    "ensure_dataset_helpers": "datasets",
    "DEMO_DATA_PREFIX": "datasets",
    "DEMO_TOKENIZER": "datasets",
    "MicroBatchIterator": "batches",
    "HashPrefetchIterator": "batches",
    "collate": "batches",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
