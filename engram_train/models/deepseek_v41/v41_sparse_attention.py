"""DeepSeek-V4.1's attention core over the keys each query actually sees, in blocks of queries:
memory linear in the sequence, forward and backward.

A query ``i`` sees its window (keys ``i - sliding_window < j <= i`` of its own document) and, on
a compressed layer, the compressed keys its selection names (at most ``index_topk``), plus the
sink (one more logit per head whose value is zero). The dense reference
(`v41_attention.DeepseekV41Attention._attend`) builds ``[b, heads, s, s + t]`` float32 scores;
here a block of ``Q`` queries builds only

- the window scores against the ``Q + sliding_window - 1`` keys the block can reach (one slice
  of the KV, no copy), and
- the compressed scores against the ``k`` keys each query selected (one gather of ``[b, Q, k,
  head_dim]`` from the compressed KV),

so the working set is ``b * heads * Q * (Q + window + k)`` float32 values, whatever the length.

The forward keeps, besides the inputs it was given (references, no copies), one float32
log-sum-exp per query and head (``4 * heads`` bytes per token); the backward recomputes each
block's probabilities from it (``p = exp(logit - lse)``, as FlashAttention does) and adds the
block's gradients into the query's, the window KV's (as key and as value: K = V), the
compressed KV's (scatter-add over the selection) and the sinks'. The softmax runs in float32;
results come back in the query's dtype. Masked keys take no probability and no gradient; a query
that sees no key attends only to its sink (output 0).

The dense path stays as the oracle: ``attention_impl: dense`` in the model config, and the tests
compare the two within 1e-6 (float32, forward and every gradient).
"""

from __future__ import annotations

import torch

from engram_train.errors import InputError

WORKING_SET_BYTES = 64 << 20
"""The float32 score working set a block of queries aims at (about four tensors of its size
are alive at the backward's peak)."""


def query_block(batch: int, heads: int, window: int, selected: int, length: int) -> int:
    """Queries per block: at least the window (the window scores of a block cover ``Q + window
    - 1`` keys, so smaller blocks compute the overlap again and again), and no more than keeps
    ``batch * heads * Q * (Q + window + selected)`` float32 values within `WORKING_SET_BYTES`."""
    budget = WORKING_SET_BYTES // (4 * max(1, batch * heads))
    block = max(64, window)
    while block > 16 and block * (block + window + selected) > budget:
        block //= 2
    return max(1, min(block, length))


def _window_mask(q0: int, q1: int, lo: int, window: int, documents: torch.Tensor | None,
                 device) -> torch.Tensor:
    """``[b or 1, Q, n]`` bool: the query at position ``q0 + a`` sees the key at ``lo + c``
    (same document, not padding, inside the window); positions are the keys' (global)."""
    offset = (torch.arange(q0, q1, device=device).unsqueeze(1)
              - torch.arange(lo, q1, device=device).unsqueeze(0))
    mask = ((offset >= 0) & (offset < window)).unsqueeze(0)
    if documents is not None:
        query_doc = documents[q0:q1].t().unsqueeze(2)  # [b, Q, 1]
        key_doc = documents[lo:q1].t().unsqueeze(1)  # [b, 1, n]
        mask = mask & (key_doc == query_doc) & (key_doc != 0)
    return mask


def _accumulation(query: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 queries (the gradient check)."""
    return torch.float64 if query.dtype == torch.float64 else torch.float32


class _Block:
    """One block's keys, masks and float32 scores (shared by the forward and the backward)."""

    def __init__(self, query, kv, compressed, indices, documents, sink, window, scale, q0, q1,
                 offset=0):
        acc = sink.dtype  # float32 (float64 for a gradient check)
        p0, p1 = q0 + offset, q1 + offset  # the queries' positions among the keys
        self.lo, self.hi = max(0, p0 - window + 1), p1
        self.query = query[q0:q1].to(acc)  # [Q, b, H, d]
        self.keys = kv[self.lo:p1].to(acc).transpose(0, 1)  # [b, n, d]
        logits = torch.einsum("qbhd,bnd->bhqn", self.query, self.keys) * scale
        mask = _window_mask(p0, p1, self.lo, window, documents, query.device)
        logits = logits.masked_fill(~mask.unsqueeze(1), -torch.inf)
        self.selected = None
        if compressed is not None:
            picks = indices[q0:q1].transpose(0, 1)  # [b, Q, k]
            self.valid = picks >= 0
            self.picks = picks.clamp_min(0)
            self.batch = torch.arange(picks.shape[0], device=picks.device).view(-1, 1, 1)
            self.selected = compressed[self.batch, self.picks]  # [b, Q, k, d] float32
            selected_logits = torch.einsum("qbhd,bqkd->bhqk", self.query, self.selected) * scale
            selected_logits = selected_logits.masked_fill(~self.valid.unsqueeze(1), -torch.inf)
            logits = torch.cat((logits, selected_logits), dim=-1)
        self.logits = logits  # [b, H, Q, n (+ k)]
        self.sink = sink.view(1, -1, 1)

    def probabilities(self, lse: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.logits - lse.unsqueeze(-1))

    def attend(self, probabilities: torch.Tensor) -> torch.Tensor:
        """``[Q, b, H, d]`` float32: the probabilities' weighted keys."""
        n = self.keys.shape[1]
        out = torch.einsum("bhqn,bnd->qbhd", probabilities[..., :n], self.keys)
        if self.selected is not None:
            out = out + torch.einsum("bhqk,bqkd->qbhd", probabilities[..., n:], self.selected)
        return out


class SparseAttention(torch.autograd.Function):
    """``forward(query [s, b, H, d], kv [s, b, d], compressed [t, b, d] | None, indices [s, b, k]
    | None, documents [s, b] | None, sink [H], window, scale)`` -> ``[s, b, H, d]`` (module
    docstring)."""

    @staticmethod
    def forward(ctx, query, kv, compressed, indices, documents, sink, window, scale, offset):
        s, b, heads = query.shape[:3]
        acc = _accumulation(query)
        compressed_f = None if compressed is None else compressed.to(acc).transpose(0, 1)
        selected = 0 if indices is None else indices.shape[-1]
        block = query_block(b, heads, window, selected, s)
        sink_f = sink.to(acc)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        lse = torch.empty(b, heads, s, dtype=acc, device=query.device)
        for q0 in range(0, s, block):
            q1 = min(s, q0 + block)
            part = _Block(query, kv, compressed_f, indices, documents, sink_f, window, scale,
                          q0, q1, offset)
            top = torch.maximum(part.logits.amax(dim=-1), part.sink)
            total = (torch.exp(part.logits - top.unsqueeze(-1)).sum(dim=-1)
                     + torch.exp(part.sink - top))
            lse[:, :, q0:q1] = top + torch.log(total)
            out[q0:q1] = part.attend(part.probabilities(lse[:, :, q0:q1])).to(query.dtype)
        ctx.save_for_backward(query, kv, compressed, indices, documents, sink, lse)
        ctx.window, ctx.scale, ctx.block, ctx.offset = window, scale, block, offset
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, kv, compressed, indices, documents, sink, lse = ctx.saved_tensors
        window, scale, block, offset = ctx.window, ctx.scale, ctx.block, ctx.offset
        s = query.shape[0]
        acc = _accumulation(query)
        compressed_f = None if compressed is None else compressed.to(acc).transpose(0, 1)
        sink_f = sink.to(acc)
        grad_query = torch.empty(query.shape, dtype=acc, device=query.device)
        grad_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        grad_compressed = None if compressed_f is None else torch.zeros_like(compressed_f)
        grad_sink = torch.zeros(sink.shape, dtype=acc, device=sink.device)
        for q0 in range(0, s, block):
            q1 = min(s, q0 + block)
            part = _Block(query, kv, compressed_f, indices, documents, sink_f, window, scale,
                          q0, q1, offset)
            block_lse = lse[:, :, q0:q1]
            probabilities = part.probabilities(block_lse)  # [b, H, Q, keys]
            grad_o = grad_out[q0:q1].to(acc)  # [Q, b, H, d]
            n = part.keys.shape[1]
            grad_p = torch.einsum("qbhd,bnd->bhqn", grad_o, part.keys)
            if part.selected is not None:
                grad_p = torch.cat((grad_p, torch.einsum("qbhd,bqkd->bhqk", grad_o,
                                                         part.selected)), dim=-1)
            # the sink's value is 0: its probability joins the row sum, its dp is 0
            row = (probabilities * grad_p).sum(dim=-1)  # [b, H, Q]
            grad_logits = probabilities * (grad_p - row.unsqueeze(-1)) * scale
            grad_sink -= (torch.exp(part.sink - block_lse) * row).sum(dim=(0, 2))
            grad_query[q0:q1] = torch.einsum("bhqn,bnd->qbhd", grad_logits[..., :n], part.keys)
            grad_keys = (torch.einsum("bhqn,qbhd->bnd", grad_logits[..., :n], part.query)
                         + torch.einsum("bhqn,qbhd->bnd", probabilities[..., :n], grad_o))
            grad_kv[part.lo:part.hi] += grad_keys.transpose(0, 1)
            if part.selected is not None:
                grad_query[q0:q1] += torch.einsum("bhqk,bqkd->qbhd", grad_logits[..., n:],
                                                  part.selected)
                grad_selected = (torch.einsum("bhqk,qbhd->bqkd", grad_logits[..., n:], part.query)
                                 + torch.einsum("bhqk,qbhd->bqkd", probabilities[..., n:], grad_o))
                grad_selected = grad_selected * part.valid.unsqueeze(-1)
                grad_compressed.index_put_((part.batch.expand_as(part.picks), part.picks),
                                           grad_selected, accumulate=True)
        if grad_compressed is not None:
            grad_compressed = grad_compressed.transpose(0, 1).to(compressed.dtype)
        return (grad_query.to(query.dtype), grad_kv.to(kv.dtype), grad_compressed, None, None,
                grad_sink.to(sink.dtype), None, None, None)


def sparse_attention(query: torch.Tensor, kv: torch.Tensor, compressed: torch.Tensor | None,
                     indices: torch.Tensor | None, documents: torch.Tensor | None,
                     sink: torch.Tensor, window: int, scale: float,
                     offset: int = 0) -> torch.Tensor:
    """Softmax attention with a sink over each query's window and selected compressed keys
    (module docstring). `documents` ``[keys, b]`` int: a window key counts only inside the
    query's document, and 0 marks padding (no key); None: one document, no padding. `indices`
    ``[s, b, k]``: each query's compressed keys, -1 for none (their validity is the
    selection's). `offset`: the first query's position among the keys (a context-parallel
    piece of queries against the whole sequence's keys; 0: the queries are the keys' tokens)."""
    s, b = query.shape[:2]
    if kv.shape[1] != b or kv.shape[0] < s + offset or kv.shape[-1] != query.shape[-1]:
        raise InputError(f"sparse attention: kv {tuple(kv.shape)} does not match the query "
                         f"{tuple(query.shape)} at position {offset}.")
    if (compressed is None) != (indices is None):
        raise InputError("sparse attention: the compressed keys and their selection come "
                         "together.")
    if indices is not None and indices.shape[:2] != (s, b):
        raise InputError(f"sparse attention: the selection {tuple(indices.shape)} belongs to "
                         f"another batch or sequence (query {tuple(query.shape)}).")
    if documents is not None:
        documents = documents.to(torch.int64)
    return SparseAttention.apply(query, kv, compressed, indices, documents, sink, int(window),
                                 float(scale), int(offset))
