"""Clear, early errors for Engram model configurations megatron cannot honour: refused when the
megatron config is built (the standalone EngramConfig, used by the reference module, accepts
hc_mult > 1)."""

import pytest

from engram_train.config import EngramMLATransformerConfig
from engram_train.config import EngramConfig

BASE = dict(
    num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16,
    qk_pos_emb_head_dim=8, v_head_dim=16, normalization="RMSNorm",
    use_engram=True, engram_tokenizer_name_or_path="tok", engram_vocab_size=[257, 263],
    max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=4, engram_layer_ids=[1, 3],
)


def make(**overrides):
    return EngramMLATransformerConfig(**dict(BASE, **overrides))


def test_engram_layer_id_beyond_num_layers():
    with pytest.raises(ValueError, match=r"engram_layer_ids.*num_layers"):
        make(engram_layer_ids=[1, 4])


def test_hc_mult_needs_hyper_connection_backbone():
    with pytest.raises(ValueError, match=r"engram_hc_mult=2 needs a multi-stream backbone: set "
                                         r"enable_hyper_connections: true"):
        make(engram_hc_mult=2)
    engram_only = {k: v for k, v in BASE.items() if k in EngramConfig.field_names()}
    assert EngramConfig(**engram_only, engram_hc_mult=4).engram_hc_mult == 4  # reference module
    assert EngramConfig(**engram_only).engram_hc_mult == 1


def test_hc_mult_follows_the_residual_streams():
    assert make(enable_hyper_connections=True).engram_hc_mult == 4
    assert make(enable_hyper_connections=True, num_residual_streams=3).engram_hc_mult == 3
    assert make(enable_hyper_connections=True, engram_hc_mult=4).engram_hc_mult == 4
    assert make(engram_hc_mult=1).engram_hc_mult == 1
    with pytest.raises(ValueError, match=r"engram_hc_mult=2 differs from num_residual_streams=4"):
        make(enable_hyper_connections=True, engram_hc_mult=2)
    # mHC without Engram: the Engram field does not matter
    assert make(enable_hyper_connections=True, use_engram=False).enable_hyper_connections


@pytest.mark.parametrize("overrides,message", [
    (dict(num_residual_streams=1), r"num_residual_streams=1 must be >= 2"),
    (dict(mhc_sinkhorn_iterations=0), r"mhc_sinkhorn_iterations=0 must be >= 1"),
    (dict(mhc_init_gating_factor=-0.1), r"mhc_init_gating_factor=-0.1 must be >= 0"),
    (dict(mtp_num_layers=1), r"mtp_num_layers"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"]),
     r"drop 'layernorm'"),
])
def test_hyper_connection_values_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(enable_hyper_connections=True, **overrides)


def test_hyper_connection_types_are_checked():
    with pytest.raises(TypeError, match="enable_hyper_connections must be a bool"):
        make(enable_hyper_connections="yes")
    with pytest.raises(TypeError, match="num_residual_streams value must be int"):
        make(enable_hyper_connections=True, num_residual_streams=4.0)


def test_context_parallel_is_accepted_but_not_hybrid():
    assert make(context_parallel_size=2).context_parallel_size == 2
    assert make(context_parallel_size=2, enable_hyper_connections=True).context_parallel_size == 2
    with pytest.raises(ValueError, match="hybrid_context_parallel"):
        make(context_parallel_size=2, hybrid_context_parallel=True)


def test_fp16_is_rejected_with_engram_only():
    with pytest.raises(ValueError, match=r"fp16 .* not supported with use_engram=True.*bf16"):
        make(fp16=True)
    assert make(fp16=True, use_engram=False).fp16


def test_engram_model_requires_use_engram():
    from engram_train.models.engram_gpt import EngramGPTModel

    with pytest.raises(ValueError, match="use_engram=True"):
        EngramGPTModel(make(use_engram=False), None, vocab_size=128, max_sequence_length=32)


def test_valid_config_passes():
    assert make().engram_hc_mult == 1
