"""Layer specs for a DeepSeek-V3-style backbone (MLA, MoE with shared experts, RMSNorm).

TE spec when Transformer Engine and CUDA are present; otherwise megatron's own local spec
with two module classes swapped for CPU-capable ones (see ``local_modules``; under context
parallelism the core attention is ``context_attention.ContextParallelCoreAttention``). The swap walks
the spec tree, so every other choice megatron makes (MoE vs dense per layer, pipeline
slicing, MLA submodules) stays megatron's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention as MegatronMLASelfAttention,
)

from engram_train.config import uses_hyper_connections
from engram_train.errors import ConfigError
from engram_train.models.local_modules import MLASelfAttention, RMSNorm, SDPACoreAttention
from engram_train.runtime.megatron_fixes import transformer_engine_available

LOCAL_SUBSTITUTIONS: dict[type, type] = {
    DotProductAttention: SDPACoreAttention,
    WrappedTorchNorm: RMSNorm,
    MegatronMLASelfAttention: MLASelfAttention,
}


def local_substitutions(config: TransformerConfig) -> dict[type, type]:
    """The local spec's swaps; under context parallelism the core attention is the CP one
    (megatron's local attention refuses CP; with TE, TE's CP attention is used instead)."""
    if config.context_parallel_size > 1:
        from engram_train.models.context_attention import ContextParallelCoreAttention

        return {**LOCAL_SUBSTITUTIONS, DotProductAttention: ContextParallelCoreAttention}
    return LOCAL_SUBSTITUTIONS


def use_transformer_engine() -> bool:
    """TE is used when it is installed and CUDA is present."""
    return torch.cuda.is_available() and transformer_engine_available()


def substitute_modules(spec: Any, table: dict[type, type]) -> Any:
    """Return ``spec`` with every module class found in ``table`` replaced, recursively."""
    if isinstance(spec, type):
        return table.get(spec, spec)
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec,
            module=substitute_modules(spec.module, table),
            submodules=substitute_modules(spec.submodules, table),
        )
    if isinstance(spec, list):
        return [substitute_modules(s, table) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: substitute_modules(getattr(spec, f.name), table) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def deepseek_v3_block_spec(
    config: TransformerConfig,
    use_te: bool | None = None,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block spec for this pipeline stage (and virtual stage)."""
    if use_te is None:
        use_te = use_transformer_engine()
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization,
        vp_stage=vp_stage, pp_rank=pp_rank,
    )
    if not use_te:
        spec = substitute_modules(spec, local_substitutions(config))
    if uses_hyper_connections(config):
        spec = hyper_connection_block_spec(spec)
    return spec


def hyper_connection_block_spec(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """Every layer of the block on n residual streams (``HyperConnectionTransformerLayer``)."""
    from engram_train.models.hyper_connection_layer import HyperConnectionTransformerLayer

    layer_specs = []
    for spec in block.layer_specs:
        if spec.module is not TransformerLayer:
            raise ConfigError(
                f"enable_hyper_connections: cannot put {spec.module} on residual streams "
                "(megatron's TransformerLayer is the layer mHC wraps)"
            )
        layer_specs.append(dataclasses.replace(spec, module=HyperConnectionTransformerLayer))
    return dataclasses.replace(block, layer_specs=layer_specs)
