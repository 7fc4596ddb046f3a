"""DeepSeek-V4.1 as a model family (``models/families.py``): its config (``v41_config.py``,
V4.1's own names), its model (``v41_model.DeepseekV41GPTModel``), its rules on a run's layout,
its transformers mapping (``hf/``: the released names, config map, quantized layout and
folder reader; the export of its released layout), its memory-plan terms (``v41_plan.py``)
and its presets. Registered by
``families.py`` on first use; the shared packages reach it through
``families.get_family("deepseek_v41")``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engram_train.config.family import DEEPSEEK_V41, MODEL_FAMILIES
from engram_train.errors import ConfigError
from engram_train.models.deepseek_v41.v41_plan import TERMS
from engram_train.models.hf_mapping import HFImport, HFMapping, ImportOptions
from engram_train.models.model_family import ModelFamily

PRESETS = ("deepseek_v41_tiny", "deepseek_v41_flash")
PACKED_DOCUMENTS = (
    "DeepSeek-V4.1 does not read megatron's per-document mask. Set data.reset_attention_mask="
    "false and, for packed documents, model.document_eos_id=<the EOS id> (attention, compression "
    "and selection per document, positions restarting; docs/deepseek-v41.md)")


def build_model(config, *, use_te: bool | None = None, vp_stage: int | None = None, **kwargs):
    """Its own model: layers carry mHC and CSA2 state (``use_te`` does not apply)."""
    from engram_train.models.deepseek_v41.v41_model import DeepseekV41GPTModel

    return DeepseekV41GPTModel(config, vp_stage=vp_stage, **kwargs)


def transformer_config(model: dict, fields: dict):
    from engram_train.models.deepseek_v41.v41_config import deepseek_v41_config

    return deepseek_v41_config(model, fields)


def backbone_fields(model: dict) -> dict:
    """megatron's defaults, then the megatron fields of V4.1's names."""
    from megatron.core.transformer import TransformerConfig

    from engram_train.models.deepseek_v41.v41_config import megatron_view

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)
                if f.default is not dataclasses.MISSING}
    return {**defaults, **megatron_view(model)}


def check_run(cfg, p, sequence_parallel: bool) -> None:
    """DeepSeek-V4.1 runs data-, tensor- (with sequence parallelism), context- (zigzag chunks
    of whole compressed runs, ``v41_context_parallel.py``), expert-, pipeline- and
    Engram-embedding-parallel, with or without recompute (docs/deepseek-v41.md 'Layouts'); not
    on a virtual pipeline (tried: megatron's interleaved schedule stalled with the
    per-message boundary shapes of ``v41_pipeline.py``)."""
    if cfg.data.reset_position_ids:
        raise ConfigError(
            "data.reset_position_ids=true with model_family=deepseek_v41: its positions are the "
            "token's index in the row (the window and CSA2 give its mask); set it to false")
    if p.virtual_pipeline is not None:
        raise ConfigError(
            f"system.virtual_pipeline_model_parallel_size={p.virtual_pipeline} with "
            "model_family=deepseek_v41: megatron's interleaved schedule with its stage boundary "
            "is not supported; set it to null (docs/deepseek-v41.md 'Layouts')")
    unit = 2 * p.context * max([1, *cfg.model.get("compress_ratios", [1])])
    if p.context > 1 and cfg.train.seq_length % unit:
        raise ConfigError(
            f"train.seq_length={cfg.train.seq_length} with system.context_parallel_size="
            f"{p.context}: each rank's two chunks must hold whole compressed runs; use a "
            f"multiple of 2 x CP x the largest compress_ratio = {unit}")


def _import_plan(hf: Path, doc: dict, options: ImportOptions) -> HFImport:
    from engram_train.models.deepseek_v41.hf.v41_import import import_plan

    return import_plan(hf, doc, options)


def _reads(doc: dict) -> bool:
    from engram_train.models.deepseek_v41.hf.v41_config_map import is_v41

    return is_v41(doc)


def _hf() -> HFMapping:
    from engram_train.models.deepseek_v41.hf.v41_hf_export import RELEASED

    return HFMapping(reads=_reads, import_plan=_import_plan, released=RELEASED)


FAMILY = ModelFamily(
    name=DEEPSEEK_V41, description=MODEL_FAMILIES[DEEPSEEK_V41], build_model=build_model,
    transformer_config=transformer_config, backbone_fields=backbone_fields, presets=PRESETS,
    check_run=check_run, hf=_hf(), plan=TERMS, packed_documents=PACKED_DOCUMENTS,
    reads_padding_mask=True)
