"""Packed documents in a DeepSeek-V4.1 row: NeMo Automodel's ``packed_seq_ids`` semantics.

A row holds several documents, each with a document id ``[s, b]`` (0: padding, which is no
document). Inside a row:

- **positions** are document-local (RoPE of the queries, the window keys and the compressed
  keys restarts at 0 with each document);
- **the window** of a query holds only keys of its own document;
- **compression** runs stay where they are (every ``r`` tokens of the row) and a compressed
  key belongs to the document of its run's first token; a run that a document boundary cuts
  belongs to the earlier document but completes only inside the later one, so no query sees it;
- **selection** (the indexer's top-k) is over the query's own document's keys, and the
  candidate source's blocks of ``candidate_block_size`` keys start at the document's first
  key (`first_run`), as NeMo's ``_select_packed`` forms them per document.

The trainer's EOS-delimited rows give the ids with `model.document_eos_id`
(`engram.v41_ngram_hash.document_ids`: 1 + the EOS strictly before a token, so an EOS ends its
own document).
"""

from __future__ import annotations

import torch


def segments(valid: torch.Tensor | None, documents: torch.Tensor | None) -> torch.Tensor | None:
    """``[s, b]`` int64 document ids with padding 0 (`valid` False), or None for a row that is
    one document without padding."""
    if documents is None:
        return None if valid is None else valid.long()
    documents = documents.long()
    return documents if valid is None else documents * valid


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """``[s, b]``: the row position where each token's document (or padding run) starts."""
    s = documents.shape[0]
    positions = torch.arange(s, device=documents.device).unsqueeze(1).expand_as(documents)
    new = torch.ones_like(documents, dtype=torch.bool)
    new[1:] = documents[1:] != documents[:-1]
    return torch.where(new, positions, 0).cummax(dim=0).values


def local_positions(documents: torch.Tensor) -> torch.Tensor:
    """``[s, b]`` positions inside each token's document."""
    s = documents.shape[0]
    return torch.arange(s, device=documents.device).unsqueeze(1) - document_starts(documents)


def first_run(documents: torch.Tensor, ratio: int) -> torch.Tensor:
    """``[s, b]``: the first compressed key of each token's document (the first run that starts
    inside it)."""
    return -(-document_starts(documents) // ratio)


def run_documents(documents: torch.Tensor, ratio: int, runs: int) -> torch.Tensor:
    """``[runs, b]``: the document of each compressed run's first token."""
    return documents[: runs * ratio: ratio]
