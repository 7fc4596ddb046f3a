"""``engram-export --format hf`` of a DeepSeek-V4.1 checkpoint: what NeMo Automodel writes for
V4.1, the folder layout ``engram-import-hf`` reads (``v41_import.py``). DeepSeek-V4.1's
`ReleasedLayout` (``models/hf_mapping.py``); ``export/hf_released.py`` writes it.

``config.json`` is the composite document (``model_type: deepseek_v41``, ``text_config`` from
the run's model section, ``vision_config`` with no layers; ``v41_config_map.py``); the tensors
carry the released names (``v41_names.py``). Each layer's ``bias_vl`` (the router's bias for
image tokens, which the text model does not hold) is written as zeros, NeMo's initial value,
so that NeMo loads the folder.

Stored dtypes (`stored_tensors`, the one place that turns a float tensor into what the folder
holds): with ``quantized`` (``engram-export``'s default, ``--hf-layout released``) the
release's layout (``v41_quant_layout.py``: FP8 E4M3 with 32 x 32 E8M0 blocks, packed FP4
experts and FP8 Engram tables with per-row scales, each with its ``.scale`` tensor); the
tensors NeMo keeps in float32 (mHC, sinks, compressor, router bias, head) stay float32, every
other one is bf16 (``--hf-layout bf16``: no quantization; ``dtype`` float32 keeps all of them
float32).
"""

from __future__ import annotations

import re

import torch

from engram_train.models.deepseek_v41.hf.v41_config_map import v41_hf_config
from engram_train.models.deepseek_v41.hf.v41_names import VISION_BIAS, v41_pieces
from engram_train.models.deepseek_v41.hf.v41_quant import V41QuantError, scale_name
from engram_train.models.deepseek_v41.hf.v41_quant_layout import (
    RELEASE_QUANTIZATION_CONFIG,
    quantize_for_release,
    release_table_scales,
)
from engram_train.models.hf_mapping import ReleasedLayout

_FLOAT32 = re.compile(r"(\.hc_(attn|ffn)_(fn|base|scale)|\.attn\.attn_sink|\.compressor\.w(kv|gate)"
                      r"\.weight|\.ffn\.gate\.bias(_vl)?)$|^head\.weight$")
_ROUTER_BIAS = "ffn.gate.e_score_correction_bias"


def stored_tensors(name: str, value: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                   quantized: bool = False) -> list[tuple[str, torch.Tensor]]:
    """What the folder stores for released tensor `name` of float `value`: [(name, tensor)],
    with its ``.scale`` where `quantized` quantizes it (module docstring)."""
    if quantized:
        return quantize_for_release(name, value)
    keep = torch.float32 if _FLOAT32.search(name) else dtype
    return [(name, value.to(keep))]


def vision_biases(key: str, shape) -> list[tuple[str, torch.Tensor]]:
    """Beside each router bias, the image tokens' bias ``bias_vl``: zeros."""
    if not key.endswith("." + _ROUTER_BIAS):
        return []
    return [(key[: -len(_ROUTER_BIAS)] + VISION_BIAS, torch.zeros(shape))]


def engram_rows(tensors: dict, model: dict) -> list[int]:
    """Each Engram layer's table rows, as stored."""
    if not model.get("use_engram"):
        return []
    return [int(tensors[f"layers.{layer}.engram.multi_head_embedding.weight"].shape[0])
            for layer in model["engram_layer_ids"]]


RELEASED = ReleasedLayout(
    pieces=v41_pieces, encode=stored_tensors, constants=vision_biases, config=v41_hf_config,
    engram_rows=engram_rows, table_scales=release_table_scales, scale_name=scale_name,
    quantization_config=RELEASE_QUANTIZATION_CONFIG, encode_error=V41QuantError)
