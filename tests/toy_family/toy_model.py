"""The toy family's config and model: megatron's ``TransformerConfig`` (composed with the
project's Engram and mHC fields, Engram off) and ``GPTModel`` on megatron's local layer spec,
with the shared CPU-capable core attention and RMSNorm (``engram_train.models.local_modules``)."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F

FIXED = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
             add_bias_linear=False, bias_activation_fusion=False, apply_rope_fusion=False,
             bias_dropout_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
             persist_layer_norm=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False)


def transformer_config(model: dict, fields: dict):
    from engram_train.config import EngramTransformerConfig

    return EngramTransformerConfig(**{**model, **fields, **FIXED})


def backbone_fields(model: dict) -> dict:
    from megatron.core.transformer import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
                if f.default is not dataclasses.MISSING}
    return {**defaults, **model}


def build_model(config, *, use_te=None, vp_stage=None, **kwargs):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from engram_train.models.local_modules import RMSNorm, SDPACoreAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    spec.submodules.self_attention.submodules = dataclasses.replace(
        attention, core_attention=SDPACoreAttention)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is WrappedTorchNorm:
            setattr(spec.submodules, name, RMSNorm)
    assert attention.core_attention is DotProductAttention  # megatron's local spec, as expected
    return GPTModel(config, spec, vp_stage=vp_stage, **kwargs)
