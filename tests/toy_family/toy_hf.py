"""The toy family's Hugging Face layout: ``config.json`` with ``model_type: toy_dense`` and the
sizes, the tensors under ``model.*`` names (a layer's fused q/k/v and gate/up weights kept
whole), one safetensors file."""

from __future__ import annotations

import re
from pathlib import Path

from engram_train.models.hf_folder import HFFolder
from engram_train.models.hf_mapping import (
    NOT_THE_MODEL,
    HFConfigError,
    HFImport,
    HFImportError,
    ImportOptions,
    Piece,
    UnmappedTensorError,
    whole,
)

MODEL_TYPE = "toy_dense"
VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
SIZES = {"num_hidden_layers": "num_layers", "hidden_size": "hidden_size",
         "num_attention_heads": "num_attention_heads",
         "num_key_value_heads": "num_query_groups", "intermediate_size": "ffn_hidden_size"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_RENAMES = {  # a norm fused into the next linear (megatron's spec on this install) or apart
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def reads(doc: dict) -> bool:
    return doc.get("model_type") == MODEL_TYPE


def pieces(key: str, shape: tuple, vocab: int) -> list[Piece]:
    shape = tuple(int(d) for d in shape)
    if key == "embedding.word_embeddings.weight":
        return [Piece(VOCAB_NAMES[0], (0, 0), (vocab, shape[1]))]
    if key == "output_layer.weight":
        return [Piece(VOCAB_NAMES[1], (0, 0), (vocab, shape[1]))]
    if key == "decoder.final_layernorm.weight":
        return whole("model.norm.weight", shape)
    match = _LAYER.match(key)
    if match is not None and match.group(2) in _RENAMES:
        return whole(f"model.layers.{match.group(1)}.{_RENAMES[match.group(2)]}", shape)
    rest = key.removeprefix("decoder.layers.")
    if rest in _RENAMES:  # megatron's homogeneous layers, stacked on a first axis: one a layer
        return [Piece(f"model.layers.{i}.{_RENAMES[rest]}", (i, *[0] * (len(shape) - 1)),
                      (1, *shape[1:]), squeeze=True) for i in range(shape[0])]
    raise UnmappedTensorError(f"{key}: no toy_dense name")


def hf_config(model: dict, vocab: int, seq_length: int | None) -> dict:
    if model.get("use_engram") or model.get("enable_hyper_connections"):
        raise HFConfigError("model.use_engram: toy_dense folders have no Engram")
    doc = {hf: int(model[ours]) for hf, ours in SIZES.items()}
    return {"model_type": MODEL_TYPE, "vocab_size": int(vocab), **doc}


def preset_from_hf(doc: dict) -> dict:
    unknown = sorted(set(doc) - set(SIZES) - NOT_THE_MODEL - {"vocab_size"})
    if unknown:
        raise HFConfigError(f"config.json {unknown[0]}: not a toy_dense field")
    return {"model_family": MODEL_TYPE, "use_engram": False,
            **{ours: int(doc[hf]) for hf, ours in SIZES.items()}}


def import_plan(hf: Path, doc: dict, options: ImportOptions) -> HFImport:
    if options != ImportOptions():
        raise HFImportError(f"{options}: a toy_dense import takes no option")
    return HFImport(section=preset_from_hf(doc), folder=HFFolder(hf), names=pieces,
                    vocab_names=VOCAB_NAMES, fields=doc)
