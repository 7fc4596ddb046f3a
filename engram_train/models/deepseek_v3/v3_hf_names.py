"""Megatron dist-checkpoint keys <-> transformers' DeepSeek-V3 names (DeepSeek-V3's
`HFMapping.pieces`).

One table serves both directions. A megatron tensor (its global key and shape) maps to one or
more *pieces* (``models/hf_mapping.Piece``): axis-aligned blocks of it that are whole
transformers tensors. SwiGLU's ``linear_fc1`` ``[2f, d]`` is two pieces (gate rows, then up
rows); a stacked expert tensor ``[E, ...]`` is one piece per expert (its leading axis dropped);
the padded embedding and output layer are one piece of their first ``vocab_size`` rows. Engram (and mHC) tensors keep the
project's module names under the decoder layer (``model.layers.<i>.engram.<name>``,
``model.layers.<i>.attn_hc.fn``) and the stream collapse is ``model.hc_head.*``.
"""

from __future__ import annotations

import re

from engram_train.models.hf_mapping import Piece, UnmappedTensorError, whole

HF_PREFIX = "model."

# Per-layer megatron suffix -> transformers suffix (one piece, whole tensor). Transformer
# Engine's fused layer-norm weights are the same tensors under other keys.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_SWIGLU = {  # [2f, d]: gate rows then up rows
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts.",
}
_EXPERTS = "mlp.experts.experts."
# Layer tensors that keep the project's module names (Engram, the mHC mappings).
_KEPT = re.compile(r"^(engram\.|attn_hc\.|ffn_hc\.)")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _swiglu(prefix: str, shape: tuple[int, ...], expert: int | None = None) -> list[Piece]:
    lead = () if expert is None else (expert,)
    rows, cols = shape[-2], shape[-1]
    if rows % 2:
        raise UnmappedTensorError(f"SwiGLU weight of shape {shape}: odd number of rows")
    half = rows // 2
    squeeze = expert is not None
    one = (1,) if squeeze else ()
    return [Piece(f"{prefix}gate_proj.weight", lead + (0, 0), one + (half, cols), squeeze),
            Piece(f"{prefix}up_proj.weight", lead + (half, 0), one + (half, cols), squeeze)]


def hf_pieces(key: str, shape: tuple[int, ...], vocab_size: int) -> list[Piece]:
    """The transformers tensors that megatron tensor `key` (global shape `shape`) holds;
    `vocab_size`: the rows of the embedding and output layer that are exported."""
    shape = tuple(int(d) for d in shape)
    if key == "embedding.word_embeddings.weight":
        return [Piece("model.embed_tokens.weight", (0, 0), (vocab_size, shape[1]))]
    if key == "output_layer.weight":
        return [Piece("lm_head.weight", (0, 0), (vocab_size, shape[1]))]
    if key == "decoder.final_layernorm.weight":
        return whole("model.norm.weight", shape)
    if key.startswith("decoder.hc_head."):  # mHC's collapse of the streams
        return whole("model.hc_head." + key[len("decoder.hc_head."):], shape)
    match = _LAYER_KEY.match(key)
    if match is None:
        raise UnmappedTensorError(f"{key}: no transformers name for this checkpoint tensor")
    layer, rest = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{layer}."
    if rest in _LAYER_RENAMES:
        return whole(prefix + _LAYER_RENAMES[rest], shape)
    if rest in _SWIGLU:
        return _swiglu(prefix + _SWIGLU[rest], shape)
    if rest.startswith(_EXPERTS):
        what = rest[len(_EXPERTS):]
        if what == "linear_fc1.weight":
            return [p for e in range(shape[0])
                    for p in _swiglu(f"{prefix}mlp.experts.{e}.", shape, expert=e)]
        if what == "linear_fc2.weight":
            return [Piece(f"{prefix}mlp.experts.{e}.down_proj.weight", (e, 0, 0),
                          (1, shape[1], shape[2]), True) for e in range(shape[0])]
    if _KEPT.match(rest):
        return whole(prefix + rest, shape)
    raise UnmappedTensorError(
        f"{key}: no transformers name for this checkpoint tensor (grouped-GEMM experts and "
        "multi-token-prediction layers are not exported)"
    )


def local_to_global(name: str) -> tuple[str, int | None]:
    """A single-rank megatron module's state-dict name -> (dist-checkpoint key, expert index):
    ``...mlp.experts.local_experts.<e>.linear_fc1.weight`` is expert e of the stacked key."""
    match = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.+)$", name)
    if match:
        return f"{match.group(1)}experts.{match.group(3)}", int(match.group(2))
    return name, None


def rope_permutation(rope_dim: int) -> list[int]:
    """Row order that turns transformers' non-interleaved RoPE layout (``rope_interleave:
    false``: first half, second half) into megatron's MLA layout (interleaved pairs): megatron
    row p holds transformers row ``p // 2 + (p % 2) * rope_dim // 2``."""
    half = rope_dim // 2
    return [p // 2 + (p % 2) * half for p in range(rope_dim)]
