"""Context-parallel core attention for runs without Transformer Engine (the CPU lane).

megatron-core's local ``DotProductAttention`` refuses ``context_parallel_size > 1``; only TE's
attention implements it. This one all-gathers K and V over the context-parallel group (the
gather's backward reduce-scatters their gradients back to the ranks that own the positions)
and applies the causal mask in global positions: the query and key rows are megatron's zigzag
chunks (``get_batch_on_this_cp_rank``: rank r holds chunks r and 2CP-1-r), so the mask is
``key position <= query position`` over those positions, not a triangle. MLA's different q/k and
v head dims pass through torch SDPA. RoPE needs nothing here: megatron's rotary embedding
already slices its table by the same zigzag (``get_pos_emb_on_this_cp_rank``).

The all-gather holds the whole sequence's K/V on every rank (O(S) memory per rank, TE's ring
exchange does not), which is fine for CI and CPU runs; GPU runs use TE's CP attention (the spec
picks this class only when TE is absent).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from engram_train.parallel.context import zigzag_positions


class ContextParallelCoreAttention(MegatronModule):
    """Core attention [s_local, b, heads, dim] -> [s_local, b, heads * v_dim] under CP, with the
    constructor of megatron's core attention slot (``SDPACoreAttention``'s, CP allowed)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        from megatron.core import parallel_state

        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        self.attn_mask_type = attn_mask_type
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(k_channels))
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)
        self._masks: dict[tuple, torch.Tensor] = {}

    def causal_mask(self, local_len: int, device) -> torch.Tensor:
        """[s_local, cp x s_local] bool, True where the query may attend (cached per length)."""
        key = (local_len, str(device))
        if key not in self._masks:
            size, rank = self.cp_group.size(), self.cp_group.rank()
            seq = local_len * size
            queries = zigzag_positions(seq, size, rank)
            keys = torch.cat([zigzag_positions(seq, size, r) for r in range(size)])
            self._masks[key] = (keys[None, :] <= queries[:, None]).to(device)
        return self._masks[key]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "packed sequences and attention bias under context parallelism need Transformer "
                "Engine's attention")
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                f"context parallelism without Transformer Engine supports causal attention only "
                f"(got attn_mask_type={mask_type}); set context_parallel_size: 1 or install TE")
        # K/V of every CP rank, in rank order; backward sums their gradients onto the owners.
        key, value = (gather_from_sequence_parallel_region(
            t, tensor_parallel_output_grad=True, group=self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        mask = self.causal_mask(q.shape[2], q.device)
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
