"""DeepSeek-V3 as a model family (``models/families.py``): its megatron config
(``v3_config.py``, MLA), its block spec (``v3_specs.py``, with Engram and mHC layers from the
shared blocks), its transformers mapping (``v3_hf_config.py``, ``v3_hf_names.py``,
``v3_hf_import.py``; with Engram or mHC the export carries ``engram_train.hf``'s modeling) and
its presets. Registered by ``families.py`` on first use; the shared packages reach it through
``families.get_family("deepseek_v3")``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engram_train.config.family import DEEPSEEK_V3, MODEL_FAMILIES
from engram_train.errors import ConfigError
from engram_train.models.hf_mapping import HFImport, HFMapping, ImportOptions
from engram_train.models.model_family import ModelFamily

# Preset keys that are not megatron config fields.
MODEL_ONLY_KEYS = {"first_k_dense_replace"}
PRESETS = ("deepseek_v3_tiny", "deepseek_v3_tiny_mhc", "deepseek_v3_small", "engram_27b",
           "moe_27b")


def build_model(config, *, use_te: bool | None = None, vp_stage: int | None = None, **kwargs):
    """megatron's GPTModel (or its Engram and/or mHC subclass, as the config asks) on
    DeepSeek-V3's block spec, Engram layers at ``engram_layer_ids`` when ``use_engram``."""
    from engram_train.config import uses_engram
    from engram_train.models.deepseek_v3.v3_specs import deepseek_v3_block_spec
    from engram_train.models.hyper_connection_model import gpt_model_class

    block = deepseek_v3_block_spec(config, use_te=use_te, vp_stage=vp_stage)
    if uses_engram(config):
        from engram_train.models.engram_specs import engram_block_spec

        block = engram_block_spec(config, block, vp_stage=vp_stage)
    return gpt_model_class(config)(config, block, vp_stage=vp_stage, **kwargs)


def transformer_config(model: dict, fields: dict):
    """``EngramMLATransformerConfig`` of a DeepSeek-V3 model section and the system fields."""
    from engram_train.config import EngramMLATransformerConfig
    from engram_train.models.deepseek_v3.v3_config import backbone_config_kwargs

    return EngramMLATransformerConfig(**backbone_config_kwargs({**model, **fields}))


def check_model_keys(model: dict) -> None:
    from engram_train.config import EngramMLATransformerConfig

    known = {f.name for f in dataclasses.fields(EngramMLATransformerConfig)} | MODEL_ONLY_KEYS
    unknown = sorted(set(model) - known)
    if unknown:
        raise ConfigError(f"model: unknown keys {unknown}; see README 'Configuration reference'")


def backbone_fields(model: dict) -> dict:
    """megatron's MLA defaults, then DeepSeek-V3's, then the section's."""
    from megatron.core.transformer import MLATransformerConfig

    from engram_train.models.deepseek_v3.v3_config import DEEPSEEK_V3_COMMON

    defaults = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)
                if f.default is not dataclasses.MISSING}
    return {**defaults, **DEEPSEEK_V3_COMMON, **model}


def check_run(cfg, sizes, sequence_parallel: bool) -> None:
    """Tensor parallelism without sequence parallelism on Transformer Engine's MLA."""
    if sizes.tensor > 1 and not sequence_parallel:
        # MLA: the RoPE key, shared by all heads, gets a partial gradient on each TP rank. The
        # local spec's MLASelfAttention sums it over TP (and scales the q-latent norm's gradient
        # for megatron's TP sum); TE's spec does neither (docs/megatron-versions.md, item 8).
        from engram_train.models.deepseek_v3 import v3_specs

        if v3_specs.use_transformer_engine():
            raise ConfigError(
                "system.tensor_model_parallel_size > 1 needs system.sequence_parallel: true (or "
                "auto) with Transformer Engine's MLA: without it megatron-core leaves the RoPE "
                "key's gradient partial on each tensor-parallel rank")


def _import_plan(hf: Path, doc: dict, options: ImportOptions) -> HFImport:
    from engram_train.models.deepseek_v3.v3_hf_import import import_plan

    return import_plan(hf, doc, options)


def _reads(doc: dict) -> bool:
    """A transformers DeepSeek-V3 ``config.json``."""
    return doc.get("model_type", DEEPSEEK_V3) == DEEPSEEK_V3


def _hf_config(model: dict, vocab: int, seq_length: int | None) -> dict:
    from engram_train.models.deepseek_v3.v3_hf_config import hf_config

    return hf_config(model, vocab, seq_length)


def _pieces(key: str, shape: tuple, vocab: int):
    from engram_train.models.deepseek_v3.v3_hf_names import hf_pieces

    return hf_pieces(key, shape, vocab)


FAMILY = ModelFamily(
    name=DEEPSEEK_V3, description=MODEL_FAMILIES[DEEPSEEK_V3], build_model=build_model,
    transformer_config=transformer_config, backbone_fields=backbone_fields, presets=PRESETS,
    check_model_keys=check_model_keys, check_run=check_run,
    hf=HFMapping(reads=_reads, import_plan=_import_plan, hf_config=_hf_config, pieces=_pieces,
                 engram_model={"model_type": "engram_deepseek_v3",
                               "architectures": ["EngramDeepseekV3ForCausalLM"]}))
