"""A run's model section <-> transformers' DeepSeek-V3 ``config.json``.

Export (`hf_config`): the megatron fields the trainer built the model from, with DeepSeek-V3's
defaults (``v3_config.py``) and megatron's own, become ``DeepseekV3Config`` fields.
A field the transformers model cannot express is refused by name. Import (`preset_from_hf`):
every field of a DeepSeek-V3 ``config.json`` is mapped to a model-preset field, accepted as
not part of the model (metadata, generation, inference layout), or refused with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engram_train.models.hf_mapping import NOT_THE_MODEL, HFConfigError

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm use their default eps


def megatron_fields(model: dict) -> dict[str, Any]:
    """The model section with DeepSeek-V3's and then megatron's defaults filled in."""
    from megatron.core.transformer import MLATransformerConfig

    from engram_train.models.deepseek_v3.v3_config import DEEPSEEK_V3_COMMON

    fields = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)
              if f.default is not dataclasses.MISSING}
    fields.update({k: v for k, v in DEEPSEEK_V3_COMMON.items() if k != "activation_func"})
    fields.update(model)
    return fields


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise HFConfigError(f"model.{field}={value!r}: {why}")


def _rope(m: dict) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) for transformers."""
    rope_type = m.get("rope_type", "rope")
    _require(float(m.get("rotary_percent", 1.0)) == 1.0, "rotary_percent", m.get("rotary_percent"),
             "transformers' MLA rotates the whole qk_pos_emb_head_dim; use 1.0")
    if rope_type == "rope":
        return {"rope_type": "default", "rope_theta": float(m["rotary_base"])}, None
    _require(rope_type == "yarn", "rope_type", rope_type, "only 'rope' and 'yarn' exist in "
             "transformers' DeepSeek-V3")
    factor, mscale = float(m["rotary_scaling_factor"]), float(m["mscale"])
    all_dim = float(m["mscale_all_dim"])
    original = int(m["original_max_position_embeddings"])
    return {
        "rope_type": "yarn", "rope_theta": float(m["rotary_base"]), "factor": factor,
        "original_max_position_embeddings": original, "beta_fast": float(m["beta_fast"]),
        "beta_slow": float(m["beta_slow"]), "mscale": mscale, "mscale_all_dim": all_dim,
        # megatron's cos/sin scale, stated so that transformers does not infer another
        "attention_factor": yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim),
    }, int(original * factor)


def _moe(m: dict, num_layers: int) -> dict:
    experts = m.get("num_moe_experts")
    if not experts:  # dense only: every layer is one of DeepSeek-V3's first dense layers
        return {"first_k_dense_replace": num_layers, "n_routed_experts": 1, "n_shared_experts": 1,
                "moe_intermediate_size": int(m["ffn_hidden_size"]), "num_experts_per_tok": 1,
                "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0}
    first_k = m.get("first_k_dense_replace") or 0
    freq = m.get("moe_layer_freq", 1)
    _require(freq == 1 or (isinstance(freq, (list, tuple)) and list(freq) == [0] * first_k
                           + [1] * (num_layers - first_k)), "moe_layer_freq", freq,
             "transformers' DeepSeek-V3 has first_k_dense_replace dense layers, then MoE only")
    _require(m.get("moe_router_score_function") == "sigmoid", "moe_router_score_function",
             m.get("moe_router_score_function"), "DeepSeek-V3 routes with sigmoid scores")
    _require(bool(m.get("moe_router_enable_expert_bias")), "moe_router_enable_expert_bias",
             m.get("moe_router_enable_expert_bias"), "DeepSeek-V3's router has a correction bias")
    shared, ffn = m.get("moe_shared_expert_intermediate_size"), int(m["moe_ffn_hidden_size"])
    _require(bool(shared) and shared % ffn == 0, "moe_shared_expert_intermediate_size", shared,
             f"DeepSeek-V3 has n_shared_experts x moe_ffn_hidden_size ({ffn}) shared units")
    topk = int(m["moe_router_topk"])
    groups, group_topk = m.get("moe_router_num_groups"), m.get("moe_router_group_topk")
    if groups and groups > 1:
        _require(bool(group_topk) and topk // group_topk == 2, "moe_router_group_topk", group_topk,
                 f"megatron scores a group by its top moe_router_topk // group_topk experts, "
                 f"transformers by its top 2: choose group_topk = moe_router_topk / 2 ({topk // 2})")
    return {
        "first_k_dense_replace": first_k, "n_routed_experts": int(experts),
        "n_shared_experts": shared // ffn, "moe_intermediate_size": ffn,
        "num_experts_per_tok": topk, "n_group": int(groups or 1), "topk_group": int(group_topk or 1),
        # megatron normalizes the top-k weights when k > 1 and never when k == 1
        "norm_topk_prob": topk > 1,
        "routed_scaling_factor": float(m.get("moe_router_topk_scaling_factor") or 1.0),
    }


def hf_config(model: dict, vocab_size: int, seq_length: int | None = None) -> dict:
    """``config.json`` of transformers' ``DeepseekV3ForCausalLM`` for a run's model section."""
    m = megatron_fields(model)
    checks = [("multi_latent_attention", True, "transformers' DeepSeek-V3 is MLA"),
              ("normalization", "RMSNorm", "DeepSeek-V3 uses RMSNorm"),
              ("gated_linear_unit", True, "DeepSeek-V3's MLPs are SwiGLU"),
              ("add_bias_linear", False, "DeepSeek-V3's linears have no bias"),
              ("qk_layernorm", True, "DeepSeek-V3 norms the q and kv latents"),
              ("layernorm_epsilon", LATENT_NORM_EPS, "transformers' latent norms use 1e-6 for every "
               "model, megatron one eps for all norms")]
    for field, want, why in checks:
        _require(m.get(field) == want, field, m.get(field), f"{why}; use {want!r}")
    _require(not m.get("mtp_num_layers"), "mtp_num_layers", m.get("mtp_num_layers"),
             "multi-token-prediction layers are not exported")
    rope, long_max = _rope(m)
    layers = int(m["num_layers"])
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": int(vocab_size), "hidden_size": int(m["hidden_size"]),
        "intermediate_size": int(m["ffn_hidden_size"]), "num_hidden_layers": layers,
        "num_attention_heads": int(m["num_attention_heads"]),
        "num_key_value_heads": int(m["num_attention_heads"]),
        "q_lora_rank": m.get("q_lora_rank"), "kv_lora_rank": int(m["kv_lora_rank"]),
        "qk_nope_head_dim": int(m["qk_head_dim"]), "qk_rope_head_dim": int(m["qk_pos_emb_head_dim"]),
        "v_head_dim": int(m["v_head_dim"]), "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": float(m.get("attention_dropout") or 0.0),
        "rms_norm_eps": float(m["layernorm_epsilon"]), "rope_parameters": rope,
        "rope_interleave": True,  # megatron's MLA rotates interleaved pairs
        "max_position_embeddings": long_max or int(seq_length or 4096),
        "initializer_range": float(m.get("init_method_std", 0.02)),
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
        "use_cache": True, "bos_token_id": None, "pad_token_id": None,
        "eos_token_id": model.get("engram_eos_id"), "dtype": "float32",
    }
    config.update(_moe(m, layers))
    return config


# -- import: a DeepSeek-V3 config.json -> model-preset fields -------------------------------

def _refuse(field: str, value: Any, why: str) -> None:
    raise HFConfigError(f"config.json {field}={value!r}: {why}")


def _hf_rope(doc: dict) -> dict:
    """megatron RoPE fields from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (the hub's DeepSeek-V3 files)."""
    params = dict(doc.get("rope_parameters") or doc.get("rope_scaling") or {})
    theta = params.pop("rope_theta", doc.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    out = {"rotary_base": float(theta)}
    if kind == "default":
        extra = {k: v for k, v in params.items() if (k, v) != ("partial_rotary_factor", 1.0)}
        if extra:
            _refuse("rope_parameters", extra, "default RoPE takes no other parameter here")
        out["rope_type"] = "rope"
        return out
    if kind != "yarn":
        _refuse("rope_parameters.rope_type", kind, "megatron's MLA has 'default' RoPE and 'yarn'")
    if params.pop("truncate", True) is not True:
        _refuse("rope_parameters.truncate", False, "megatron rounds yarn's correction range")
    factor = float(params.pop("factor"))
    mscale, all_dim = float(params.pop("mscale", 1.0) or 0.0), float(params.pop("mscale_all_dim", 0.0) or 0.0)
    out.update(rope_type="yarn", rotary_scaling_factor=factor,
               original_max_position_embeddings=int(params.pop("original_max_position_embeddings")),
               beta_fast=float(params.pop("beta_fast", 32)), beta_slow=float(params.pop("beta_slow", 1)),
               mscale=mscale, mscale_all_dim=all_dim)
    attention = params.pop("attention_factor", None)
    ours = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    if mscale == 0.0 or all_dim == 0.0:  # transformers then infers get_mscale(factor)
        ours_hf = yarn_mscale(factor)
        if attention is None and not math.isclose(ours_hf, ours, rel_tol=1e-9):
            _refuse("rope_parameters.mscale", mscale, "transformers' and megatron's yarn scales "
                    "differ for this mscale/mscale_all_dim pair")
    if attention is not None and not math.isclose(float(attention), ours, rel_tol=1e-9):
        _refuse("rope_parameters.attention_factor", attention, f"megatron's yarn gives {ours}")
    if params:
        _refuse("rope_parameters", params, "fields megatron's yarn does not have")
    return out


def _hf_moe(doc: dict, layers: int) -> dict:
    first_k = int(doc.get("first_k_dense_replace") or 0)
    if doc.get("moe_layer_freq", 1) != 1:
        _refuse("moe_layer_freq", doc["moe_layer_freq"], "only 1 (every layer after "
                "first_k_dense_replace is MoE) exists in transformers' DeepSeek-V3")
    if first_k >= layers:  # dense only
        return {"first_k_dense_replace": None, "num_moe_experts": None, "moe_ffn_hidden_size": None,
                "moe_shared_expert_intermediate_size": None}
    topk, experts = int(doc["num_experts_per_tok"]), int(doc["n_routed_experts"])
    groups, group_topk = int(doc.get("n_group") or 1), int(doc.get("topk_group") or 1)
    if doc.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse("scoring_func", doc["scoring_func"], "DeepSeek-V3 routing is sigmoid")
    if doc.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse("topk_method", doc["topk_method"], "transformers' DeepSeek-V3 routes with noaux_tc")
    norm = bool(doc.get("norm_topk_prob", True))
    if norm != (topk > 1):
        _refuse("norm_topk_prob", norm, f"megatron normalizes the top-k weights exactly when k > 1 "
                f"(num_experts_per_tok={topk})")
    if groups > 1 and topk // group_topk != 2:
        _refuse("topk_group", group_topk, f"megatron scores a group by its top num_experts_per_tok "
                f"// topk_group experts, transformers by its top 2 (needs topk_group = {topk // 2})")
    if experts % groups:
        _refuse("n_group", groups, f"must divide n_routed_experts={experts}")
    moe = int(doc["moe_intermediate_size"])
    out = {"first_k_dense_replace": first_k, "num_moe_experts": experts, "moe_router_topk": topk,
           "moe_ffn_hidden_size": moe,
           "moe_shared_expert_intermediate_size": moe * int(doc.get("n_shared_experts") or 0),
           "moe_router_topk_scaling_factor": float(doc.get("routed_scaling_factor") or 1.0)}
    if not out["moe_shared_expert_intermediate_size"]:
        _refuse("n_shared_experts", doc.get("n_shared_experts"), "DeepSeek-V3 layers have shared "
                "experts (the trainer's MoE spec builds them)")
    if groups > 1:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    if "aux_loss_alpha" in doc:
        out["moe_aux_loss_coeff"] = float(doc["aux_loss_alpha"])
    return out


def preset_from_hf(doc: dict) -> dict:
    """Backbone fields of a model preset for a DeepSeek-V3 ``config.json`` (`HFConfigError`
    naming the field for one that cannot be honoured)."""
    if doc.get("model_type", "deepseek_v3") != "deepseek_v3":
        _refuse("model_type", doc.get("model_type"), "only deepseek_v3 folders are imported")
    for field, want, why in [("hidden_act", "silu", "DeepSeek-V3's MLPs are SwiGLU"),
                             ("attention_bias", False, "megatron's MLA linears have no bias"),
                             ("pretraining_tp", 1, "a layout of the original training, not a model "
                              "field transformers honours either"),
                             ("rms_norm_eps", LATENT_NORM_EPS, "transformers' latent norms always "
                              "use 1e-6 and megatron one eps for every norm")]:
        if doc.get(field, want) != want:
            _refuse(field, doc[field], why)
    heads = int(doc["num_attention_heads"])
    if int(doc.get("num_key_value_heads") or heads) != heads:
        _refuse("num_key_value_heads", doc["num_key_value_heads"], "MLA has one latent for all "
                f"heads: use num_attention_heads={heads}")
    quant = doc.get("quantization_config")
    if quant and (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"):
        _refuse("quantization_config", quant, "only block-scaled fp8 (e4m3) weights are read")
    layers = int(doc["num_hidden_layers"])
    preset = {
        "num_layers": layers, "hidden_size": int(doc["hidden_size"]),
        "num_attention_heads": heads, "ffn_hidden_size": int(doc["intermediate_size"]),
        "q_lora_rank": doc.get("q_lora_rank"), "kv_lora_rank": int(doc["kv_lora_rank"]),
        "qk_head_dim": int(doc["qk_nope_head_dim"]), "qk_pos_emb_head_dim": int(doc["qk_rope_head_dim"]),
        "v_head_dim": int(doc["v_head_dim"]),
        "init_method_std": float(doc.get("initializer_range", 0.02)),
        "attention_dropout": float(doc.get("attention_dropout") or 0.0),
    }
    preset.update(_hf_rope(doc))
    preset.update(_hf_moe(doc, layers))
    known = set(NOT_THE_MODEL) | {
        "hidden_act", "attention_bias", "pretraining_tp", "rms_norm_eps", "num_attention_heads",
        "num_key_value_heads", "num_hidden_layers", "hidden_size", "intermediate_size",
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "attention_dropout", "rope_parameters", "rope_scaling", "rope_theta", "first_k_dense_replace",
        "moe_layer_freq", "num_experts_per_tok", "n_routed_experts", "n_group", "topk_group",
        "scoring_func", "topk_method", "norm_topk_prob", "moe_intermediate_size", "n_shared_experts",
        "routed_scaling_factor", "aux_loss_alpha", "vocab_size"}
    unknown = sorted(set(doc) - known)
    if unknown:
        _refuse(unknown[0], doc[unknown[0]], f"not a DeepSeek-V3 field this import knows "
                f"(all unknown: {unknown}); remove it if it does not change the model")
    return preset
