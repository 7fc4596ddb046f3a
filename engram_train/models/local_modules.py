"""CPU-capable replacements for two local-spec modules of megatron-core 0.16.1.

- ``SDPACoreAttention``: megatron's local ``DotProductAttention`` rejects MLA's
  ``k_channels``/``v_channels`` (q/k and v head dims differ in MLA). This one accepts them
  and uses ``torch.nn.functional.scaled_dot_product_attention``.
- ``RMSNorm``: megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (and MoE with
  TP > 1 requires it). This one marks its weight ``sequence_parallel`` so megatron's
  ``finalize_model_grads`` all-reduces its gradient over the TP group, as TE's norms do.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Core attention [s, b, heads, dim] -> [s, b, heads * v_dim] on torch SDPA."""

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
        self._check_context_parallel(config)
        self.attn_mask_type = attn_mask_type
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

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
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "packed sequences and attention bias need Transformer Engine's attention"
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron masks are True where attention is NOT allowed
        return self._attend(query, key, value, mask, causal)

    @staticmethod
    def _check_context_parallel(config: TransformerConfig) -> None:
        if config.context_parallel_size != 1:
            raise ValueError(
                "context_parallel_size > 1 needs Transformer Engine's attention; the local spec's "
                "SDPACoreAttention supports context_parallel_size=1 only"
            )

    def _attend(self, query, key, value, mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """torch SDPA on megatron's [s, b, h, d] (K/V may cover more positions than Q; grouped
        K/V heads are repeated), dropout under megatron's RNG tracker -> [s_q, b, h * dv]."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        if k.shape[1] != q.shape[1]:  # grouped-query attention
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale
                )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale
            )
        # [b, h, s, dv] -> [s, b, h * dv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


class RMSNorm(torch.nn.Module):
    """RMSNorm with megatron's norm constructor signature and sequence-parallel support."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the local RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)
