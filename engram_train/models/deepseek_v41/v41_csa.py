"""CSA2, V4.1's compressed branch: the compressor of a full layer, the indexer that picks each
query's compressed keys, and the state a full layer hands to the layers after it.

- `DeepseekV41Compressor` pools each run of ``r`` tokens into one key (= value) of width
  ``head_dim``: per channel a softmax over the run of a gate projection weighs a value
  projection (float32 parameters and arithmetic); at r = 1 a plain projection. Then RMSNorm.
  Only complete runs give a key: a sequence of s tokens has ``s // r`` compressed keys, key t
  made of tokens ``[t r, (t+1) r)`` and rotated at position ``t r``.
- `DeepseekV41Indexer` (frozen: its weights take no gradient, as released) scores a query
  against the compressed keys a query may see (key t once token ``(t+1) r - 1`` is at or
  before it): ``sum_h relu(q_h . k) w_h`` with FP4 (E2M1, E8M0 scales) queries and keys, and
  keeps the ``index_topk`` best; at the candidate source it first keeps the best
  ``candidate_topk_blocks`` blocks of ``candidate_block_size`` keys (by their best key, the
  query's newest block always kept), and later index layers select inside those blocks.
- `CSAState` carries the compressed KV (FP4, E4M3 scales, blocks of 16, after RoPE), the index
  keys, the selection and the candidates from layer to layer; a layer returns a new state,
  never changes the one it got (the compressed KV keeps its graph to the full layer's weights).

Sequence-first: hidden ``[s, b, h]``, keys ``[t, b, d]``, selection ``[s, b, k]`` (ascending
key ids, then -1), candidates ``[s, b, candidate_topk_blocks]`` (block ids). The indexer
scores queries in blocks, so its memory is linear in the sequence (its time is not: every
query scores every compressed key it may see, ``s * t`` products, as DeepSeek's indexer does).
Top-k choices break ties by the lower key id (`ordered_top`), never by the width of the score
row: a prefix selects the same keys alone as inside a longer sequence. Under tensor
parallelism the compressor and the index keys are replicated; the index heads could split with
a sum of the scores over the group before the top-k (not done: one process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram_train.errors import InputError
from engram_train.models.deepseek_v41.v41_args import FP8_BLOCK
from engram_train.models.deepseek_v41.v41_documents import first_run
from engram_train.models.deepseek_v41.v41_primitives import (
    DeepseekV41RMSNorm,
    apply_rope,
    fake_quantize,
)

INDEX_WORKING_SET_BYTES = 64 << 20
"""The float32 ``[Q, b, index_heads, keys]`` products a block of indexer queries aims at."""


@dataclass(frozen=True)
class CSAState:
    """What a full layer publishes for the layers after it (a layer never mutates it)."""

    compressed_kv: torch.Tensor | None = None
    """``[t, b, head_dim]``: the compressed keys (= values), rotated and FP4-rounded."""
    compressed_valid: torch.Tensor | None = None
    """``[t, b]`` bool: every token of the key's run is a real (not padding) token."""
    compressed_documents: torch.Tensor | None = None
    """``[t, b]`` int64: the document of each run's first token, with packed documents
    (`v41_documents`); None for a row that is one document."""
    index_keys: torch.Tensor | None = None
    """``[t, b, index_head_dim]``: the indexer's keys, rotated and FP4-rounded."""
    topk_indices: torch.Tensor | None = None
    """``[s, b, k]`` int64: each query's selected keys, ascending, then -1 for none."""
    candidates: torch.Tensor | None = None
    """``[s, b, candidate_topk_blocks]`` int64: the first key of each of the candidate
    source's blocks of ``candidate_block_size`` keys for each query, ascending, then -1 (None
    before it; `candidate_mask` gives the keys). Blocks start at the query's document's first
    key."""
    compression_ratio: int = 0

    def replace(self, **fields) -> CSAState:
        return dataclasses.replace(self, **fields)


class DeepseekV41Compressor(nn.Module):
    """A full layer's pooling of ``ratio`` tokens into one compressed key (module docstring).
    ``wkv`` and ``wgate`` are float32 whatever the model dtype (as released)."""

    def __init__(self, args, ratio: int, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.ratio = int(ratio)
        self.wkv = nn.Linear(args.hidden_size, args.head_dim, bias=False, device=device,
                             dtype=torch.float32)
        self.wgate = (nn.Linear(args.hidden_size, args.head_dim, bias=False, device=device,
                                dtype=torch.float32) if self.ratio > 1 else None)
        self.norm = DeepseekV41RMSNorm(args.head_dim, args.rms_norm_eps, device, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> the unrotated keys ``[s // ratio, b, head_dim]`` in hidden's dtype."""
        if self.ratio == 1:
            return self.norm(F.linear(hidden, self.wkv.weight.to(hidden.dtype)))
        runs = hidden.shape[0] // self.ratio
        x = hidden[: runs * self.ratio].float()
        values = F.linear(x, self.wkv.weight.float()).unflatten(0, (runs, self.ratio))
        gates = F.linear(x, self.wgate.weight.float()).unflatten(0, (runs, self.ratio))
        pooled = (values * gates.softmax(dim=1)).sum(dim=1)
        return self.norm(pooled.to(hidden.dtype))


def ordered_top(scores: torch.Tensor, k: int, sorted: bool = False) -> torch.Tensor:
    """The indices of the `k` largest of `scores` ``[..., n]`` (float), ties to the lower index,
    in no particular order. ``torch.topk`` breaks ties by where its algorithm happens to look,
    which changes with ``n``: a query's selection (relu makes many index scores exactly 0) then
    depended on how many compressed keys the whole sequence has, so appending tokens moved the
    logits of earlier ones. Here each score becomes one int64 whose high half orders the floats
    and whose low half prefers the lower index, so the choice depends on the scores alone.
    `sorted`: best first (``torch.topk``'s order)."""
    bits = (scores.float() + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ties 0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the float
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - index)
    return keys.topk(k, dim=-1, sorted=sorted).indices


def ascending_picks(indices: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """`indices` where `keep`, ascending, then -1 for the rest (the selection's canonical form)."""
    spare = torch.iinfo(torch.int64).max
    ordered = torch.where(keep, indices, spare).sort(dim=-1).values
    return ordered.masked_fill(ordered == spare, -1)


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """``[..., topk_blocks]`` int64: the blocks of `block_size` keys with the best key score
    (-inf: not visible), ascending, -1 for none; the block of the newest visible key is always
    in. `visible` ``[..., 1]`` counts each query's visible keys; `scores` ``[..., n]`` may stop
    at the last key any of these queries sees (the later blocks are invisible to them)."""
    width = scores.shape[-1]
    padded = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    best = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (visible - 1) // block_size
    blocks = torch.arange(best.shape[-1], device=scores.device)
    best = best.masked_fill(blocks == newest, torch.inf)
    top = ordered_top(best, min(topk_blocks, best.shape[-1]))
    picks = ascending_picks(top, best.gather(-1, top) > -torch.inf)
    return F.pad(picks, (0, topk_blocks - picks.shape[-1]), value=-1)


def candidate_mask(starts: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """``[..., width]`` bool: the keys inside the blocks that begin at `starts` ``[..., m]``
    (first keys, -1 none)."""
    keys = starts.unsqueeze(-1) + torch.arange(block_size, device=starts.device)
    keys = torch.where((starts >= 0).unsqueeze(-1) & (keys < width), keys, width).flatten(-2)
    keep = torch.zeros(*starts.shape[:-1], width + 1, dtype=torch.bool, device=starts.device)
    return keep.scatter(-1, keys, True)[..., :width]


class DeepseekV41Indexer(nn.Module):
    """An index layer's key selection (module docstring). ``wk`` and ``k_norm`` (the index
    keys from the compressed latent) exist on a full layer only. Frozen."""

    def __init__(self, args, role, device=None, dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk = args.index_topk
        self.quantize = bool(args.fake_quantize)
        self.owns_keys = role.kv_source
        self.candidate_source, self.uses_candidates = role.candidate_source, role.uses_candidates
        self.topk_blocks, self.block_size = args.candidate_topk_blocks, args.candidate_block_size
        factory = {"device": device, "dtype": dtype}
        self.wq_b = nn.Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False,
                              **factory)
        self.weights_proj = nn.Linear(args.hidden_size, self.num_heads, bias=False, **factory)
        if self.owns_keys:
            self.wk = nn.Linear(args.head_dim, self.head_dim, bias=False, **factory)
            self.k_norm = DeepseekV41RMSNorm(self.head_dim, args.rms_norm_eps, **factory)
        self.requires_grad_(False)

    def keys(self, latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The index keys ``[t, b, index_head_dim]`` of a full layer's unrotated latent."""
        keys = apply_rope(self.k_norm(self.wk(latent)), angles)
        return fake_quantize(keys, "mxfp4", FP8_BLOCK, self.quantize)

    def queries(self, query_latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The index queries ``[s, b, index_heads, index_head_dim]``, rotated and FP4-rounded."""
        queries = self.wq_b(query_latent).unflatten(-1, (self.num_heads, self.head_dim))
        return fake_quantize(apply_rope(queries, angles), "mxfp4", FP8_BLOCK, self.quantize)

    def block_scores(self, queries, weights, keys, state, q0: int, q1: int,
                     documents=None, positions=None, last: int | None = None) -> tuple:
        """Queries ``q0..q1``'s float scores ``[Q, b, n]`` over the first ``n`` keys (those the
        block's last query, at position `last`, may see; -inf: not visible to that query:
        later, padded or of another document), and each query's visible-key count ``[Q, 1,
        1]``. `positions` ``[s]``: the queries' positions (None: ``0..s-1``); `documents`
        ``[s, b]`` the queries' documents."""
        ratio = state.compression_ratio
        last = q1 - 1 if last is None else last
        n = min(keys.shape[0], (last + 1) // ratio)
        scores = torch.einsum("qbhd,nbd->qbhn", queries[q0:q1], keys[:n])
        scores = (scores.relu() * weights[q0:q1].unsqueeze(-1)).sum(dim=2)
        positions = (torch.arange(q0, q1, device=keys.device) if positions is None
                     else positions[q0:q1])
        visible = ((positions + 1) // ratio).view(-1, 1, 1)
        allowed = torch.arange(n, device=keys.device) < visible
        if state.compressed_valid is not None:
            allowed = allowed & state.compressed_valid[:n].t().unsqueeze(0)
        if documents is not None:
            query_doc = documents[q0:q1].unsqueeze(-1)  # [Q, b, 1]
            allowed = allowed & (query_doc == state.compressed_documents[:n].t().unsqueeze(0))
            allowed = allowed & (query_doc > 0)
        return scores.masked_fill(~allowed, -torch.inf), visible

    def candidate_starts(self, scores: torch.Tensor, visible: torch.Tensor,
                         firsts: torch.Tensor | None) -> torch.Tensor:
        """``[Q, b, candidate_topk_blocks]``: the first keys of the query's candidate blocks.
        Blocks start at the query's document's first key `firsts` ``[Q, b]`` (0 without
        documents), as NeMo forms them over each document's own keys."""
        if firsts is None:
            blocks = select_candidate_blocks(scores, visible, self.topk_blocks, self.block_size)
            return torch.where(blocks >= 0, blocks * self.block_size, -1)
        width = scores.shape[-1]
        shifted = firsts.unsqueeze(-1) + torch.arange(width, device=scores.device)
        local = scores.gather(-1, shifted.clamp_max(width - 1)).masked_fill(shifted >= width,
                                                                            -torch.inf)
        seen = torch.isfinite(local).sum(dim=-1, keepdim=True)
        blocks = select_candidate_blocks(local, seen, self.topk_blocks, self.block_size)
        return torch.where(blocks >= 0, firsts.unsqueeze(-1) + blocks * self.block_size, -1)

    def query_block(self, batch: int, keys: int) -> int:
        """Queries per block: the ``[Q, b, index_heads, keys]`` float32 products within
        `INDEX_WORKING_SET_BYTES` (at least 1, at most 256)."""
        per_query = 4 * max(1, batch * self.num_heads * keys)
        return max(1, min(256, INDEX_WORKING_SET_BYTES // per_query))

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, query_latent: torch.Tensor,
                latent: torch.Tensor | None, angles: torch.Tensor,
                compressed_angles: torch.Tensor, state: CSAState,
                documents: torch.Tensor | None = None, share=None) -> CSAState:
        """The state with this layer's selection (and, on a full layer, its index keys; on
        the candidate source, the candidates). `hidden` ``[s, b, h]``, `query_latent` ``[s, b,
        q_lora_rank]`` (q_norm's output), `latent` the full layer's unrotated compressed keys,
        `documents` ``[length, b]`` packed document ids of the whole sequence (padding 0) or
        None, `share` the rank's context-parallel share (`v41_context_parallel`; None: the
        queries are the whole sequence). Queries go in blocks (`query_block`): no ``[s, t]``
        score tensor exists at once."""
        keys = state.index_keys
        if self.owns_keys:
            keys = self.keys(latent, compressed_angles)
            if share is not None:
                keys = share.gather(keys, state.compression_ratio)
        if keys is None:
            raise InputError("a reindex layer needs the index keys of a full layer before it "
                             "(pass the state the previous layer returned).")
        s, b = hidden.shape[:2]
        width = keys.shape[0]
        k = min(self.topk, width)
        picks = torch.full((s, b, k), -1, dtype=torch.long, device=hidden.device)
        candidates = state.candidates
        if self.candidate_source:
            candidates = torch.full((s, b, self.topk_blocks), -1, dtype=torch.long,
                                    device=hidden.device)
        elif self.uses_candidates and width and (
                candidates is None or candidates.shape[:2] != (s, b)):
            raise InputError("an index layer after the candidate source needs its "
                             "candidates (pass the state the previous layer returned).")
        if width == 0:
            return state.replace(index_keys=keys, topk_indices=picks, candidates=candidates)
        queries = self.queries(query_latent, angles)
        weights = self.weights_proj(hidden) * (self.head_dim ** -0.5 * self.num_heads ** -0.5)
        block = self.query_block(b, width)
        positions = None if share is None else share.positions
        firsts = None
        if documents is not None:
            firsts = first_run(documents, state.compression_ratio)
            if share is not None:  # the queries' own documents and first keys
                documents = documents.index_select(0, positions)
                firsts = firsts.index_select(0, positions)
        for q0 in range(0, s, block):
            q1 = min(s, q0 + block)
            last = None if share is None else share.position_of(q1 - 1)  # ascending
            scores, visible = self.block_scores(queries, weights, keys, state, q0, q1,
                                                documents, positions, last)
            if scores.shape[-1] == 0:
                continue
            if self.candidate_source:
                candidates[q0:q1] = self.candidate_starts(
                    scores, visible, None if firsts is None else firsts[q0:q1])
            elif self.uses_candidates:
                inside = candidate_mask(candidates[q0:q1], scores.shape[-1], self.block_size)
                scores = scores.masked_fill(~inside, -torch.inf)
            top = ordered_top(scores, min(k, scores.shape[-1]))
            chosen = ascending_picks(top, torch.isfinite(scores.gather(-1, top)))
            picks[q0:q1, :, :chosen.shape[-1]] = chosen
        return state.replace(index_keys=keys, topk_indices=picks, candidates=candidates)
