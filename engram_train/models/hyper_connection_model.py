"""HyperConnectionGPTModel: megatron's GPTModel on n residual streams (mHC).

Three things change at the model's edges; the layers in between are
``HyperConnectionTransformerLayer`` (or its Engram variant), chosen by the block spec:

- entry (first pipeline stage): the embedding output ``[s, b, h]`` is copied to the n streams,
  megatron's ``[s, b, n*h]`` activation (``_preprocess``, tracks megatron-core 0.16.1/0.19.2:
  its first return value is the decoder input);
- exit (last stage): ``decoder.hc_head`` (``HyperHead``) collapses the streams right before the
  decoder's final norm (a forward pre-hook on megatron's ``final_layernorm``, so the norm and
  every name megatron gives it stay megatron's);
- between stages: megatron's schedules allocate ``[seq, b, hidden_size]`` buffers; the
  ``mhc_pipeline_shapes`` patch (``runtime/patches.py``) passes them ``seq x n`` so they hold
  ``[s, b, n*h]``, and the chunk reads and writes its boundary tensors through that same
  memory (``set_input_tensor`` and ``forward`` reinterpret the shape; a contiguous view, no
  copy).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from engram_train.config import uses_hyper_connections
from engram_train.errors import ConfigError, InputError
from engram_train.models.engram_gpt import EngramGPTModel
from engram_train.models.hyper_connection import HyperHead
from engram_train.models.hyper_connection_layer import (
    keep_float32,
    mark_sequence_parallel,
    parameter_device,
    split_streams,
)


def expand_streams(x: torch.Tensor, num_streams: int) -> torch.Tensor:
    """``[s, b, h]`` -> ``[s, b, n*h]``: every stream starts as the embedding."""
    s, b, h = x.shape
    return x.unsqueeze(2).expand(s, b, num_streams, h).reshape(s, b, num_streams * h)


def _collapse_before_norm(head: HyperHead, args):
    (hidden_states, *rest) = args
    return (head(split_streams(hidden_states, head.num_streams)), *rest)


class HyperConnectionModelMixin:
    """The mHC edges of a GPTModel (module docstring); mixed in before ``GPTModel`` or
    ``EngramGPTModel``."""

    def __init__(self, config, *args, **kwargs):
        if not uses_hyper_connections(config):
            raise ConfigError(f"{type(self).__name__} needs enable_hyper_connections=true")
        super().__init__(config, *args, **kwargs)
        self.num_streams = config.num_residual_streams
        if self.post_process and self.decoder.final_layernorm is None:
            raise ConfigError("mHC collapses the streams before the decoder's final norm; this "
                             "model's last stage has none (post_layer_norm=False)")
        if self.decoder.final_layernorm is not None:
            head = HyperHead(config.hidden_size, self.num_streams,
                             norm_eps=config.layernorm_epsilon, device=parameter_device(config))
            if config.perform_initialization:
                head.reset_parameters(gating_factor=config.mhc_init_gating_factor,
                                      std=config.init_method_std)
            mark_sequence_parallel(head, config.sequence_parallel)
            keep_float32(head)
            self.decoder.hc_head = head
            self.decoder.final_layernorm.register_forward_pre_hook(
                lambda norm, args: _collapse_before_norm(self.decoder.hc_head, args)
            )

    def _preprocess(self, *args, **kwargs):
        output = super()._preprocess(*args, **kwargs)
        decoder_input = output[0]
        if decoder_input is None:  # not the first stage: the input tensor comes by P2P
            return output
        wrapped = isinstance(decoder_input, WrappedTensor)
        streams = expand_streams(decoder_input.unwrap() if wrapped else decoder_input,
                                 self.num_streams)
        return (WrappedTensor(streams) if wrapped else streams, *output[1:])

    def set_input_tensor(self, input_tensor) -> None:
        tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        super().set_input_tensor([self._from_pipeline(t) for t in tensors])

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if self.post_process or not isinstance(output, torch.Tensor):
            return output
        return self._to_pipeline(output)

    def _from_pipeline(self, tensor):
        """The schedule's ``[n*s, b, h]`` buffer as the ``[s, b, n*h]`` streams."""
        if tensor is None:
            return None
        n = self.num_streams
        rows, batch, width = tensor.shape
        if width != self.config.hidden_size or rows % n:
            raise InputError(
                f"pipeline input {tuple(tensor.shape)} is not a [n*s, b, h] mHC buffer (n={n}, "
                f"h={self.config.hidden_size}): run megatron's schedules with the "
                "mhc_pipeline_shapes patch applied (engram_train.runtime.initialize_distributed)"
            )
        return tensor.view(rows // n, batch, n * width)

    def _to_pipeline(self, output: torch.Tensor) -> torch.Tensor:
        """This stage's ``[s, b, n*h]`` streams as the ``[n*s, b, h]`` P2P tensor."""
        s, b, width = output.shape
        view = output.view(s * self.num_streams, b, width // self.num_streams)
        return make_viewless_tensor(inp=view, requires_grad=view.requires_grad, keep_graph=True)


class HyperConnectionGPTModel(HyperConnectionModelMixin, GPTModel):
    """megatron's GPTModel with the mHC backbone (no Engram)."""


class EngramHyperConnectionGPTModel(HyperConnectionModelMixin, EngramGPTModel):
    """The Engram model on the mHC backbone."""


def gpt_model_class(config) -> type:
    """megatron's GPTModel, or its Engram and/or mHC subclass, as the config asks (megatron's
    own config, or one composed with Engram's and mHC's fields: `engram_train.config`)."""
    from engram_train.config import uses_engram

    engram, mhc = uses_engram(config), uses_hyper_connections(config)
    return {
        (False, False): GPTModel,
        (True, False): EngramGPTModel,
        (False, True): HyperConnectionGPTModel,
        (True, True): EngramHyperConnectionGPTModel,
    }[(engram, mhc)]
