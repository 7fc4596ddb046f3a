"""DeepSeek-V3-style backbone: MLA attention (with RMSNorm on the compressed q and kv latents,
DeepSeek-V3's ``q_a_layernorm``/``kv_a_layernorm``: megatron's ``qk_layernorm`` for MLA), MoE
(routed + shared experts, first-k dense), RMSNorm, RoPE, SwiGLU. Presets are plain dicts of
megatron config fields: the sizes live in ``conf/model/*.yaml`` (engram_train.models.presets),
and any field can be overridden there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import MLATransformerConfig

from engram_train.errors import ConfigError

# Fields that every DeepSeek-V3-style model shares; presets add sizes.
DEEPSEEK_V3_COMMON: dict[str, Any] = dict(
    multi_latent_attention=True,
    qk_layernorm=True,
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    add_bias_linear=False,
    gated_linear_unit=True,
    activation_func=F.silu,
    bias_activation_fusion=False,
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    gradient_accumulation_fusion=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    rope_type="rope",
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-3,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
    moe_router_pre_softmax=False,
    moe_grouped_gemm=False,
    moe_token_dispatcher_type="allgather",
    moe_router_dtype="fp32",
)

def moe_layer_freq(num_layers: int, first_k_dense_replace: int) -> list[int]:
    """DeepSeek-V3's layout: the first k layers are dense, the rest MoE."""
    if not 0 <= first_k_dense_replace <= num_layers:
        raise ConfigError(
            f"first_k_dense_replace={first_k_dense_replace} must be in [0, num_layers={num_layers}]"
        )
    return [0] * first_k_dense_replace + [1] * (num_layers - first_k_dense_replace)


def backbone_config_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """Megatron config kwargs from a preset: DeepSeek-V3 defaults, then the preset's fields."""
    kwargs = dict(DEEPSEEK_V3_COMMON)
    kwargs.update(fields)
    first_k = kwargs.pop("first_k_dense_replace", None)
    if first_k is not None and kwargs.get("num_moe_experts"):
        kwargs["moe_layer_freq"] = moe_layer_freq(kwargs["num_layers"], first_k)
    if isinstance(kwargs.get("activation_func"), str):
        kwargs["activation_func"] = {"silu": F.silu, "gelu": F.gelu}[kwargs["activation_func"]]
    if not torch.cuda.is_available():
        kwargs.setdefault("use_cpu_initialization", True)
        # gloo does not group batch_isend_irecv like NCCL: with the interleaved schedule a rank
        # sends and receives to/from the same peer in one batch (PP=2: prev == next) and gloo
        # can match an activation with a gradient of the same shape. megatron's unbatched path
        # orders the ops and uses a second group for one direction when PP=2.
        kwargs.setdefault("batch_p2p_comm", False)
    return kwargs


def deepseek_v3_config(config_class: type = MLATransformerConfig, **fields: Any):
    """A megatron (MLA) transformer config for a DeepSeek-V3-style model."""
    return config_class(**backbone_config_kwargs(fields))
