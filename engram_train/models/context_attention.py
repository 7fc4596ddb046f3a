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

from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from engram_train.models.local_modules import SDPACoreAttention
from engram_train.parallel.context import zigzag_positions


class ContextParallelCoreAttention(SDPACoreAttention):
    """Core attention [s_local, b, heads, dim] -> [s_local, b, heads * v_dim] under CP: the local
    spec's ``SDPACoreAttention`` (its constructor and SDPA call) over the gathered K/V."""

    def __init__(self, config: TransformerConfig, *args, pg_collection=None, **kwargs):
        super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        from megatron.core import parallel_state

        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        self._masks: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _check_context_parallel(config: TransformerConfig) -> None:
        pass  # any context_parallel_size: this class implements it

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
        return self._attend(query, key, value, self.causal_mask(query.shape[0], query.device),
                            causal=False)
