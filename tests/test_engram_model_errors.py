"""Clear, early errors for Engram model configurations megatron cannot honour."""

import pytest

from engram_train.config import EngramMLATransformerConfig
from engram_train.models.engram_gpt import validate_engram_model_config

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
    with pytest.raises(ValueError, match=r"engram_hc_mult=2.*Set engram_hc_mult: 1"):
        validate_engram_model_config(make(engram_hc_mult=2))


def test_context_parallel_is_rejected():
    cfg = make()
    cfg.context_parallel_size = 2
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        validate_engram_model_config(cfg)


def test_engram_model_requires_use_engram():
    with pytest.raises(ValueError, match="use_engram=True"):
        validate_engram_model_config(make(use_engram=False))


def test_valid_config_passes():
    validate_engram_model_config(make())
