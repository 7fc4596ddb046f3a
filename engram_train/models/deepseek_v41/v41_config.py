"""A DeepSeek-V4.1 preset as the project's model config: `DeepseekV41ModelConfig`, megatron's
``TransformerConfig`` composed with the Engram, mHC and family fields
(``config.EngramTransformerConfig``) plus the backbone's own fields under V4.1's names
(``deepseek_v41``: a `DeepseekV41BackboneArgs`).

A V4.1 preset (``conf/model/deepseek_v41_*.yaml``) states ``model_family: deepseek_v41``, the
backbone fields under V4.1's names (``num_hidden_layers``, ``moe_intermediate_size``,
``n_routed_experts``, ``rms_norm_eps``, ...: the fields of `DeepseekV41BackboneArgs`) and the
Engram fields under the project's names (``engram.variant`` maps them onto V4.1's). The
megatron fields the rest of the project reads (``num_layers``, ``num_moe_experts``,
``layernorm_epsilon``, ...) are derived from V4.1's (`megatron_fields`); a megatron field the
preset gives itself is refused, so each size has one name.

Under a pipeline (``pipeline_model_parallel_size > 1``) the stages exchange float32 tensors
whose shape megatron's schedules learn per message (``pipeline_dtype`` float32,
``variable_seq_lengths``: ``v41_pipeline.py``). Selective recompute takes the modules of
`SELECTIVE_MODULES`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engram_train.config import EngramTransformerConfig
from engram_train.config.family import DEEPSEEK_V41, ModelFamilyConfig
from engram_train.config.mhc import HyperConnectionConfig
from engram_train.config.model import EngramConfig
from engram_train.errors import ConfigError
from engram_train.models.deepseek_v41.v41_args import DeepseekV41BackboneArgs

V41_FIELDS = tuple(f.name for f in dataclasses.fields(DeepseekV41BackboneArgs))
"""The backbone fields a V4.1 preset gives, under V4.1's names."""


def megatron_fields(args: DeepseekV41BackboneArgs) -> dict[str, Any]:
    """megatron's names for V4.1's sizes (what the trainer, the optimizer, the parameter counter
    and the run-config checks read), and the fusions the CPU path lacks turned off."""
    fields = dict(
        num_layers=args.num_hidden_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=1,
        kv_channels=args.head_dim, ffn_hidden_size=args.moe_intermediate_size,
        num_moe_experts=args.n_routed_experts, moe_router_topk=args.num_experts_per_tok,
        moe_ffn_hidden_size=args.moe_intermediate_size,
        moe_shared_expert_intermediate_size=args.moe_intermediate_size * args.n_shared_experts,
        moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
        normalization="RMSNorm", layernorm_epsilon=args.rms_norm_eps,
        init_method_std=args.initializer_range, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, hidden_dropout=0.0, attention_dropout=args.attention_dropout,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
    )
    if not torch.cuda.is_available():
        fields.update(use_cpu_initialization=True, batch_p2p_comm=False)
    return fields


@dataclass
class DeepseekV41ModelConfig(EngramTransformerConfig):
    """megatron's ``TransformerConfig`` with every Engram, mHC and family field, and V4.1's
    backbone fields in ``deepseek_v41`` (module docstring)."""

    model_family: str = DEEPSEEK_V41
    deepseek_v41: DeepseekV41BackboneArgs | None = None
    """The backbone fields under V4.1's names (the released V4.1-Flash's when not given)."""

    def __post_init__(self) -> None:
        if self.deepseek_v41 is None:
            self.deepseek_v41 = DeepseekV41BackboneArgs()
        if self.model_family != DEEPSEEK_V41:
            raise ConfigError(f"model_family={self.model_family!r}: a DeepseekV41ModelConfig "
                              f"is model_family={DEEPSEEK_V41!r}.")
        if self.enable_hyper_connections:
            raise ConfigError("enable_hyper_connections=true with model_family=deepseek_v41: "
                              "V4.1 has its own single-pass mHC (hc_mult streams); drop it.")
        given, self.engram_hc_mult = self.engram_hc_mult, None  # the project mHC's rule: 1
        mhc = self.recompute_modules is not None and "mhc" in self.recompute_modules
        if mhc:  # V4.1's own mHC, always recomputed; the project mHC's rule refuses the name
            self.recompute_modules = [m for m in self.recompute_modules if m != "mhc"]
        pipelined = self.pipeline_model_parallel_size > 1  # the stage boundary: v41_pipeline
        if pipelined:
            self.pipeline_dtype = torch.float32
        # megatron refuses variable_seq_lengths with its allgather token dispatcher, which
        # V4.1's own MoE does not use: set after megatron's checks (again on a replace())
        self.variable_seq_lengths = False
        super().__post_init__()
        self.variable_seq_lengths = pipelined
        if self.context_parallel_size > 1 and self.deepseek_v41.attention_impl != "sparse":
            raise ConfigError(f"context_parallel_size={self.context_parallel_size} with "
                              "attention_impl=dense: context parallelism runs the sparse "
                              "attention; drop attention_impl (sparse is the default).")
        if mhc:
            self.recompute_modules = [*self.recompute_modules, "mhc"]
        selective_recompute(self)
        streams = self.deepseek_v41.hc_mult
        if given not in (None, streams):
            raise ConfigError(f"engram_hc_mult={given} with hc_mult={streams}: V4.1's Engram "
                              "takes one key per mHC stream; leave engram_hc_mult unset.")
        self.engram_hc_mult = streams


SELECTIVE_MODULES = ("core_attn", "moe", "mhc")
"""The ``recompute_modules`` V4.1 recomputes under ``recompute_granularity=selective``:
``core_attn`` the softmax over the window and the selected compressed keys (its float32
``[b, heads, s, keys]`` logits and probabilities), ``moe`` the whole MoE sublayer, ``mhc`` the
mHC mappings and collapses (always recomputed in V4.1: ``v41_hyper_connection.recomputed``)."""


def selective_recompute(config) -> frozenset[str]:
    """The modules a layer recomputes (`SELECTIVE_MODULES`; none unless ``selective``); a
    module V4.1 has no recompute for is refused, naming it."""
    if config.recompute_granularity != "selective":
        return frozenset()
    modules = frozenset(config.recompute_modules or ())
    unknown = sorted(modules - set(SELECTIVE_MODULES))
    if unknown:
        raise ConfigError(f"recompute_modules {unknown} with model_family=deepseek_v41: its "
                          f"selective recompute covers {list(SELECTIVE_MODULES)}.")
    return modules


_OWN = (set(V41_FIELDS) | {f.name for f in dataclasses.fields(EngramConfig)}
        | {f.name for f in dataclasses.fields(HyperConnectionConfig)}
        | {f.name for f in dataclasses.fields(ModelFamilyConfig)})


def split_v41_preset(model: dict[str, Any]) -> tuple[DeepseekV41BackboneArgs, dict[str, Any]]:
    """A V4.1 model section -> (its backbone args, the Engram/mHC/family fields). A key that
    is neither (a megatron name of a V4.1 size, a typo) is refused in one line."""
    unknown = sorted(set(model) - _OWN)
    if unknown:
        raise ConfigError(f"model: unknown keys {unknown} for model_family=deepseek_v41 (its "
                          "backbone fields take V4.1's names: docs/deepseek-v41.md 'The model')")
    args = DeepseekV41BackboneArgs(**{k: v for k, v in model.items() if k in V41_FIELDS})
    return args, {k: v for k, v in model.items() if k not in V41_FIELDS}


def megatron_view(model: dict[str, Any]) -> dict[str, Any]:
    """A V4.1 model section with megatron's names added (for the run-config checks that read
    ``num_layers``, ``num_moe_experts``, ...)."""
    args, rest = split_v41_preset(model)
    return {**megatron_fields(args), **rest}


def deepseek_v41_config(model: dict[str, Any], system: dict[str, Any]) -> DeepseekV41ModelConfig:
    """`DeepseekV41ModelConfig` of a V4.1 model section and the trainer's system fields
    (parallel sizes, dtypes, recompute)."""
    args, rest = split_v41_preset(model)
    return DeepseekV41ModelConfig(**megatron_fields(args), **rest, **system, deepseek_v41=args)
