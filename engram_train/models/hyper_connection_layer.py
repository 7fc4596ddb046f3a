"""HyperConnectionTransformerLayer: megatron's TransformerLayer on n residual streams (mHC).

The layer takes and returns the streams as megatron's ``[s, b, n*h]`` activation (what pipeline
stages exchange, as upstream megatron-core's mHC does). Each sublayer runs megatron's own
modules unchanged (``input_layernorm`` + ``self_attention``, ``pre_mlp_layernorm`` + ``mlp``,
MoE included) on the collapsed input ``u`` of its ``HyperConnection`` (``attn_hc``,
``ffn_hc``), and the mapping writes the output back to the streams. Only ``forward`` is
overridden; it tracks megatron-core 0.16.1 / 0.19.2 ``TransformerLayer._forward_attention`` /
``_forward_mlp`` (same submodule calls, minus the inference-only fused paths, cross attention,
and the activation-offload hooks). Under selective recompute, megatron's ``core_attn`` and MoE
recompute stay inside the modules; ``mlp`` is recomputed here as megatron does it, and ``mhc``
(in ``recompute_modules``, upstream's name; on by default with mHC, ``config/mhc.py``) keeps
only each sublayer's X and output for the backward and recomputes the mapping from X.

With sequence parallelism the streams are ``[s/tp, b, n*h]``: the mappings see this rank's
tokens, so their parameters carry ``sequence_parallel`` and megatron's gradient finalization
sums their gradients over TP (as it does for layer norms). When upstream megatron-core ships
mHC in a supported release, this layer steps aside for its ``TransformerLayer``.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from engram_train.models.hyper_connection import HyperConnection
from engram_train.errors import ConfigError, InputTypeError


def mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """megatron sums the gradients of parameters marked ``sequence_parallel`` over TP."""
    for param in module.parameters():
        setattr(param, "sequence_parallel", bool(sequence_parallel))


def keep_float32(module: torch.nn.Module) -> None:
    """The mappings stay float32 under bf16/fp16, parameters, gradients and optimizer state
    (DeepSeek-V4 keeps them in float32): ``models/builder.py`` holds parameters marked
    ``keep_fp32`` out of ``Float16Module``'s cast, and megatron's optimizers then take them
    as float32 parameters."""
    for param in module.parameters():
        setattr(param, "keep_fp32", True)


def recomputes_mappings(config) -> bool:
    """Whether the mappings are recomputed in the backward: ``mhc`` in ``recompute_modules``
    (put there by default with mHC, ``config/mhc.py``)."""
    return "mhc" in (config.recompute_modules or [])


def parameter_device(config):
    """Where megatron puts a module's parameters: the default device with
    ``use_cpu_initialization`` (the CPU, or the meta device of a parameter count), else CUDA."""
    return None if config.use_cpu_initialization else torch.cuda.current_device()


def build_hyper_connection(config) -> HyperConnection:
    """One sublayer's mapping, initialized as the spec says (``mhc_init_gating_factor``)."""
    hc = HyperConnection(
        config.hidden_size, config.num_residual_streams, config.mhc_sinkhorn_iterations,
        norm_eps=config.layernorm_epsilon, device=parameter_device(config),
    )
    if config.perform_initialization:
        hc.reset_parameters(gating_factor=config.mhc_init_gating_factor,
                            std=config.init_method_std)
    mark_sequence_parallel(hc, config.sequence_parallel)
    keep_float32(hc)
    return hc


def split_streams(hidden_states: torch.Tensor, num_streams: int) -> torch.Tensor:
    """megatron's ``[s, b, n*h]`` activation -> ``[s, b, n, h]`` (a view)."""
    s, b, width = hidden_states.shape
    return hidden_states.view(s, b, num_streams, width // num_streams)


class HyperConnectionTransformerLayer(TransformerLayer):
    """A megatron layer whose attention and MLP/MoE sublayers read and write n streams."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if not config.enable_hyper_connections:
            raise ConfigError("HyperConnectionTransformerLayer needs enable_hyper_connections=true")
        self.num_streams = config.num_residual_streams
        self.recompute_mhc = recomputes_mappings(config)
        self.attn_hc = build_hyper_connection(config)
        self.ffn_hc = build_hyper_connection(config)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        if args:
            raise InputTypeError("HyperConnectionTransformerLayer takes its inputs by keyword "
                            "(as megatron's TransformerBlock passes them)")
        kwargs.pop("dynamic_inference_decode_only", None)
        streams = split_streams(hidden_states, self.num_streams)
        streams = self.attn_hc.sublayer(streams, lambda u: self._attention(u, kwargs),
                                        self.recompute_mhc)
        streams = self.ffn_hc.sublayer(
            streams, lambda u: self._mlp(u, kwargs.get("padding_mask")), self.recompute_mhc
        )
        output = streams.reshape(hidden_states.shape)
        output = make_viewless_tensor(inp=output, requires_grad=output.requires_grad,
                                      keep_graph=True)
        return output, kwargs.get("context")

    def _sublayer_output(self, output_with_bias) -> torch.Tensor:
        """y = dropout(output + bias): megatron's bias-dropout-add without the residual."""
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        return torch.nn.functional.dropout(output, p=self.hidden_dropout, training=self.training)

    def _attention(self, u: torch.Tensor, kwargs: dict) -> torch.Tensor:
        output_with_bias = self.self_attention(
            self.input_layernorm(u),
            attention_mask=kwargs.get("attention_mask"),
            inference_context=kwargs.get("inference_context"),
            rotary_pos_emb=kwargs.get("rotary_pos_emb"),
            rotary_pos_cos=kwargs.get("rotary_pos_cos"),
            rotary_pos_sin=kwargs.get("rotary_pos_sin"),
            rotary_pos_cos_sin=kwargs.get("rotary_pos_cos_sin"),
            attention_bias=kwargs.get("attention_bias"),
            packed_seq_params=kwargs.get("packed_seq_params"),
            sequence_len_offset=kwargs.get("sequence_len_offset"),
        )
        return self._sublayer_output(output_with_bias)

    def _mlp(self, u: torch.Tensor, padding_mask) -> torch.Tensor:
        normed = self.pre_mlp_layernorm(u)
        if self.recompute_mlp:
            output_with_bias = tensor_parallel.checkpoint(
                functools.partial(self.mlp, padding_mask=padding_mask), False, normed
            )
        else:
            output_with_bias = self.mlp(normed, padding_mask=padding_mask)
        return self._sublayer_output(output_with_bias)
