"""CPU-capable replacements for local-spec modules of megatron-core 0.16.1 / 0.19.2.

- ``SDPACoreAttention``: megatron's local ``DotProductAttention`` rejects MLA's
  ``k_channels``/``v_channels`` (q/k and v head dims differ in MLA). This one accepts them
  and uses ``torch.nn.functional.scaled_dot_product_attention``.
- ``RMSNorm``: megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` (and MoE with
  TP > 1 requires it). This one marks its weight ``sequence_parallel`` so megatron's
  ``finalize_model_grads`` all-reduces its gradient over the TP group, as TE's norms do.
- ``MLASelfAttention``: megatron's, with the KV down projection replicated over TP
  (``ReplicatedLinear``, what TE's spec does with ``parallel_mode="duplicated"``) instead of a
  ``ColumnParallelLinear``, and without sequence parallelism the RoPE key's gradient summed over
  TP and the q-latent norm's gradient scaled for megatron's TP sum; see its docstring for the
  gradients megatron's forms lose or double.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention as MegatronMLASelfAttention,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from engram_train.errors import ConfigError


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
            raise ConfigError(
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


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` backward. (megatron's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns
    ``grad``: a non-contiguous gradient, such as a slice's, comes back unsummed.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class RMSNorm(torch.nn.Module):
    """RMSNorm with megatron's norm constructor signature and sequence-parallel support.
    ``grad_scale`` (1 unless ``MLASelfAttention`` sets it) scales its weight's gradient."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        if config.layernorm_zero_centered_gamma:
            raise ConfigError("layernorm_zero_centered_gamma is not supported by the local RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.grad_scale == 1.0 else _ScaleGrad.apply(self.weight, self.grad_scale)
        return F.rms_norm(x.float(), weight.shape, weight.float(), self.eps).to(x.dtype)


class ReplicatedLinear(MegatronModule):
    """``y = x W^T`` with W whole on every TP rank, megatron's linear call convention
    (``(output, None)``). Under sequence parallelism each rank applies it to its own tokens, so
    W carries ``sequence_parallel`` and megatron sums its gradient over TP. ``sum_last=n``: the
    last ``n`` outputs' gradient is summed over ``tp_group`` in backward (outputs whose
    consumers are split over TP, on tokens every rank holds whole). Checkpoints see the same
    tensor as the column-parallel layer's (same key, same global shape), replicated."""

    def __init__(self, config: TransformerConfig, weight: torch.Tensor, tp_group=None,
                 sum_last: int = 0):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(weight)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        setattr(self.weight, "tensor_model_parallel", False)
        self.tp_group, self.sum_last = tp_group, sum_last

    def forward(self, x: torch.Tensor):
        y = F.linear(x, self.weight)
        if self.sum_last:
            head, tail = y.split([y.shape[-1] - self.sum_last, self.sum_last], dim=-1)
            y = torch.cat([head, _SumGradOverGroup.apply(tail, self.tp_group)], dim=-1)
        return y, None

    def get_extra_state(self) -> None:  # the column-parallel layer's empty ``_extra_state``
        return None

    def set_extra_state(self, state) -> None:
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets)


class MLASelfAttention(MegatronMLASelfAttention):
    """megatron's MLA self-attention whose KV down projection, under TP, is one
    ``ReplicatedLinear`` (the branch megatron takes for TE's duplicated linear) rather than a
    ``ColumnParallelLinear``.

    Why: with the column-parallel layer megatron-core (0.16.1, 0.19.2,
    ``get_query_key_value_tensors``) gathers its output over TP and splits the gradient back.
    The decoupled RoPE key ``k_pos_emb`` in that output is shared by all heads, and each TP rank
    holds only some heads: its gradient is partial on every rank, and the split keeps one
    rank's part only. The down projection's weight and the layer's input then miss the other
    ranks' share (measured: the first gradients of ``linear_kv_down_proj`` and the input norms
    differ by 5e-3 between TP2 + SP and one rank). On the replicated path megatron gathers
    ``k_pos_emb`` over the sequence under sequence parallelism, whose backward (a
    reduce-scatter) sums those parts. Without sequence parallelism megatron gathers nothing
    there, so the projection sums the RoPE key's gradient over TP itself (``sum_last``); the
    latent's own gradient is already whole on every rank (the up projections' input
    all-reduce), and so is the weight's, which megatron then leaves alone.

    Also without sequence parallelism: megatron's ``finalize_model_grads`` sums every
    ``q_layernorm`` gradient over TP (with ``qk_layernorm``), right for a sequence-split latent
    but double for the q latent every TP rank holds whole; its norm's gradient is scaled by
    ``1/TP`` so the sum is the gradient (``kv_layernorm`` is not summed by megatron).
    Only ``__init__`` is extended: the projection is swapped once megatron has built it (its
    weight gathered from the column-parallel shards, so the values are those megatron
    initialized)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        projection = self.linear_kv_down_proj
        group = getattr(projection, "tp_group", None)
        if (group is None or group.size() == 1
                or not getattr(projection.weight, "tensor_model_parallel", False)):
            return
        shards = [torch.empty_like(projection.weight) for _ in range(group.size())]
        dist.all_gather(shards, projection.weight.detach().contiguous(), group=group)
        whole_tokens = not config.sequence_parallel
        self.linear_kv_down_proj = ReplicatedLinear(
            config, torch.cat(shards, dim=0), tp_group=group,
            sum_last=config.qk_pos_emb_head_dim if whole_tokens else 0)
        norm = getattr(self, "q_layernorm", None)
        if whole_tokens and config.qk_layernorm and norm is not None and list(norm.parameters()):
            if not isinstance(norm, RMSNorm):
                raise ConfigError(
                    f"tensor parallelism without sequence parallelism needs the local RMSNorm as "
                    f"MLA's q_layernorm (got {type(norm).__name__}): megatron sums its gradient "
                    "over the tensor-parallel group")
            norm.grad_scale = 1.0 / group.size()
