"""EngramGPTModel: megatron's GPTModel with an EngramTransformerBlock decoder.

It takes the micro-batch's ``input_ids`` on every pipeline stage (middle stages need them for
their Engram layers) plus, when the data path produced them, ``engram_hash_ids``
(``{layer_id: [B, S, K]}``); otherwise it hashes ``input_ids`` itself, once per micro-batch,
with an ``NgramHashMapping`` built from ``engram_tokenizer_name_or_path``.
"""

from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from megatron.core.models.gpt import gpt_model as _gpt_model_module
from megatron.core.models.gpt.gpt_model import GPTModel

from engram_train.models.engram_block import EngramTransformerBlock, pack_hash_ids


@contextlib.contextmanager
def _decoder_class(block_cls: type):
    """GPTModel.__init__ builds ``TransformerBlock`` by name (megatron-core 0.16.1); build
    ``block_cls`` instead, in the same order, so RNG use and parameter names are unchanged."""
    original = _gpt_model_module.TransformerBlock
    _gpt_model_module.TransformerBlock = block_cls
    try:
        yield
    finally:
        _gpt_model_module.TransformerBlock = original


def validate_engram_model_config(config) -> None:
    """Combinations the Engram integration cannot honour, rejected before any module is built."""
    if not getattr(config, "use_engram", False):
        raise ValueError("EngramGPTModel needs use_engram=True; build megatron's GPTModel otherwise")
    if config.engram_hc_mult != 1:
        raise ValueError(
            f"engram_hc_mult={config.engram_hc_mult}: megatron GPT layers carry one residual stream; "
            "hc_mult > 1 needs a hyper-connection backbone. Set engram_hc_mult: 1"
        )
    if config.context_parallel_size > 1:
        raise ValueError(
            "Engram's short conv and n-gram windows span the sequence, which context parallelism "
            f"splits (context_parallel_size={config.context_parallel_size}); set it to 1"
        )


class EngramGPTModel(GPTModel):
    """GPTModel whose Engram layers receive per-micro-batch hash ids."""

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        validate_engram_model_config(config)
        with _decoder_class(EngramTransformerBlock):
            super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self._hash_mapping = None

    @property
    def hash_mapping(self):
        """Built on first use: only needed when the batch carries no precomputed hash ids."""
        if self._hash_mapping is None:
            from engram_train.engram.hashing import NgramHashMapping

            if not self.config.engram_tokenizer_name_or_path:
                raise ValueError(
                    "the batch has no engram_hash_ids and engram_tokenizer_name_or_path is unset: "
                    "set it (model.engram_tokenizer_name_or_path) or hash in the data path"
                )
            self._hash_mapping = NgramHashMapping(self.config)
        return self._hash_mapping

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *args,
        engram_hash_ids: Mapping[int, torch.Tensor] | torch.Tensor | None = None,
        **kwargs,
    ):
        if engram_hash_ids is None:
            if input_ids is None:
                raise ValueError("EngramGPTModel needs input_ids or engram_hash_ids on every pipeline stage")
            engram_hash_ids = self.hash_mapping.hash(input_ids)
        packed = pack_hash_ids(engram_hash_ids, self.config.engram_layer_ids)
        self.decoder.set_engram_hash_ids(packed)
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
