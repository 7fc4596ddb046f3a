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
key ids, -1 past the visible keys), candidates ``[s, b, t]``. Under tensor parallelism the
compressor and the index keys are replicated; the index heads could split with a sum of the
scores over the group before the top-k (not done: one process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram_train.errors import InputError
from engram_train.models.deepseek_v41.v41_args import FP8_BLOCK
from engram_train.models.deepseek_v41.v41_primitives import (
    DeepseekV41RMSNorm,
    apply_rope,
    fake_quantize,
)


@dataclass(frozen=True)
class CSAState:
    """What a full layer publishes for the layers after it (a layer never mutates it)."""

    compressed_kv: torch.Tensor | None = None
    """``[t, b, head_dim]``: the compressed keys (= values), rotated and FP4-rounded."""
    compressed_valid: torch.Tensor | None = None
    """``[t, b]`` bool: every token of the key's run is a real (not padding) token."""
    index_keys: torch.Tensor | None = None
    """``[t, b, index_head_dim]``: the indexer's keys, rotated and FP4-rounded."""
    topk_indices: torch.Tensor | None = None
    """``[s, b, k]`` int64: each query's selected keys, ascending, -1 for none."""
    candidates: torch.Tensor | None = None
    """``[s, b, t]`` bool: keys inside the candidate source's blocks (None before it)."""
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


def select_candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """``[..., t]`` bool: the keys of the `topk_blocks` blocks of `block_size` keys with the
    best key score (-inf: not visible), the block of the newest visible key always in.
    `visible` ``[..., 1]`` counts each query's visible keys."""
    width = scores.shape[-1]
    padded = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    best = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    newest = (visible - 1) // block_size
    blocks = torch.arange(best.shape[-1], device=scores.device)
    best = best.masked_fill(blocks == newest, torch.inf)
    top = best.topk(min(topk_blocks, best.shape[-1]), dim=-1)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter(-1, top.indices,
                                                            top.values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


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

    def scores(self, hidden, query_latent, keys, angles, state) -> tuple[torch.Tensor, ...]:
        """``[s, b, t]`` float scores (-inf: not visible), each query's visible-key count
        ``[s, 1, 1]`` and the visibility ``[s, b, t]``."""
        queries = self.wq_b(query_latent).unflatten(-1, (self.num_heads, self.head_dim))
        queries = fake_quantize(apply_rope(queries, angles), "mxfp4", FP8_BLOCK,
                                self.quantize)
        weights = self.weights_proj(hidden) * (self.head_dim ** -0.5 * self.num_heads ** -0.5)
        scores = torch.einsum("sbhd,tbd->sbht", queries, keys)
        scores = (scores.relu() * weights.unsqueeze(-1)).sum(dim=2)
        positions = torch.arange(hidden.shape[0], device=hidden.device)
        visible = ((positions + 1) // state.compression_ratio).view(-1, 1, 1)
        allowed = torch.arange(keys.shape[0], device=hidden.device) < visible
        if state.compressed_valid is not None:
            allowed = allowed & state.compressed_valid.t().unsqueeze(0)
        return scores.masked_fill(~allowed, -torch.inf), visible, allowed

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, query_latent: torch.Tensor,
                latent: torch.Tensor | None, angles: torch.Tensor,
                compressed_angles: torch.Tensor, state: CSAState) -> CSAState:
        """The state with this layer's selection (and, on a full layer, its index keys; on
        the candidate source, the candidates). `hidden` ``[s, b, h]``, `query_latent` ``[s, b,
        q_lora_rank]`` (q_norm's output), `latent` the full layer's unrotated compressed keys."""
        keys = state.index_keys
        if self.owns_keys:
            keys = self.keys(latent, compressed_angles)
        if keys is None:
            raise InputError("a reindex layer needs the index keys of a full layer before it "
                             "(pass the state the previous layer returned).")
        s, b = hidden.shape[:2]
        if keys.shape[0] == 0:
            empty = torch.empty(s, b, 0, dtype=torch.long, device=hidden.device)
            candidates = (torch.empty(s, b, 0, dtype=torch.bool, device=hidden.device)
                          if self.candidate_source else state.candidates)
            return state.replace(index_keys=keys, topk_indices=empty, candidates=candidates)
        scores, visible, allowed = self.scores(hidden, query_latent, keys, angles, state)
        candidates = state.candidates
        if self.candidate_source:
            candidates = select_candidate_blocks(scores, visible, self.topk_blocks,
                                                 self.block_size) & allowed
        elif self.uses_candidates:
            if candidates is None or candidates.shape != scores.shape:
                raise InputError("an index layer after the candidate source needs its "
                                 "candidates (pass the state the previous layer returned).")
            scores = scores.masked_fill(~candidates, -torch.inf)
        top = scores.topk(min(self.topk, keys.shape[0]), dim=-1, sorted=False)
        indices = top.indices.sort(dim=-1).values
        indices = torch.where(torch.isfinite(scores.gather(-1, indices)), indices, -1)
        return state.replace(index_keys=keys, topk_indices=indices, candidates=candidates)
