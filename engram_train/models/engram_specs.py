"""Choose Engram or plain layers per global layer id (MoE and dense alike).

Starts from the backbone family's block spec for this stage (e.g. ``deepseek_v3_block_spec``) and turns the
specs of layers listed in ``engram_layer_ids`` into ``EngramTransformerLayer`` specs. Layers
are numbered as megatron numbers them (pipeline offsets, virtual stages, custom layouts).
MTP layers are not in the decoder block and stay plain.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from engram_train.engram.engram_module import Engram
from engram_train.engram.variant import engram_branch_class
from engram_train.models.engram_layer import (
    EngramHyperConnectionLayer,
    EngramTransformerLayer,
    EngramTransformerLayerSubmodules,
)
from engram_train.models.hyper_connection_layer import HyperConnectionTransformerLayer
from engram_train.errors import InputError


def stage_layer_ids(config, vp_stage: int | None = None, pp_rank: int | None = None) -> list[int]:
    """Global (0-based) ids of the decoder layers this pipeline (virtual) stage builds."""
    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))


def engram_layer_spec(layer_spec: ModuleSpec, engram_spec=Engram) -> ModuleSpec:
    """A TransformerLayer spec (single- or multi-stream) -> the same layer with an Engram branch."""
    if not (isinstance(layer_spec.module, type) and issubclass(layer_spec.module, TransformerLayer)):
        raise InputError(f"cannot add Engram to {layer_spec.module}: expected a TransformerLayer spec")
    fields = {f.name: getattr(layer_spec.submodules, f.name) for f in dataclasses.fields(layer_spec.submodules)}
    module = (EngramHyperConnectionLayer
              if issubclass(layer_spec.module, HyperConnectionTransformerLayer)
              else EngramTransformerLayer)
    return dataclasses.replace(
        layer_spec,
        module=module,
        submodules=EngramTransformerLayerSubmodules(**fields, engram=engram_spec),
    )


def engram_block_spec(
    config, block: TransformerBlockSubmodules, vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """``block`` (a family's block spec for this stage) with Engram layers at
    ``engram_layer_ids``, each with the branch of ``engram_variant`` (`engram_branch_class`)."""
    ids = stage_layer_ids(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if len(ids) != len(block.layer_specs):
        raise RuntimeError(f"stage layer ids {ids} do not match {len(block.layer_specs)} layer specs")
    engram_ids = set(config.engram_layer_ids)
    branch = engram_branch_class(config)
    layer_specs = [
        engram_layer_spec(spec, branch) if layer_id in engram_ids else spec
        for layer_id, spec in zip(ids, block.layer_specs)
    ]
    return dataclasses.replace(block, layer_specs=layer_specs)
