"""EngramTransformerLayer: a megatron TransformerLayer with the Engram branch at its entry.

``h = h + Engram(h, hash_ids)``, then megatron's unchanged layer forward. The micro-batch's
hash ids arrive through the ``context`` argument that megatron's block already hands to every
layer (and saves with the inputs under full recompute, so a recomputed layer sees the same
ids); decoder-only GPT models leave that slot unused. The block is ``[L, B, S, K]``
(``models/engram_gpt.py``) and this layer reads its slice by its position in
``engram_layer_ids``.
The Engram table is sharded by the model's embedding-parallel method
(``engram_train.parallel.engram_embedding_parallel``: ``alltoall`` over the Engram
embedding-parallel group, or ``allreduce`` over this layer's tensor-parallel group).
Dtypes: the Engram projections, norms and conv are built in the config's ``params_dtype`` (so
under bf16 the branch's output, and with it the residual stream, stays bf16); the table in
``engram_table_dtype`` (fp32 by default, independent of the backbone's precision).
Tracks megatron-core 0.16.1 (``TransformerLayer.forward(hidden_states, ..., context=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from engram_train.engram.engram_module import engram_table_dtype
from engram_train.models.hyper_connection_layer import (
    HyperConnectionTransformerLayer,
    split_streams,
)
from engram_train.parallel.lookup import engram_embedding_parallel


@dataclass
class EngramTransformerLayerSubmodules(TransformerLayerSubmodules):
    """megatron's layer slots plus the Engram branch."""

    engram: Union[ModuleSpec, type, None] = field(default=None)


class EngramTransformerLayer(TransformerLayer):
    """A megatron layer whose input first receives the Engram memory of its global layer id."""

    def __init__(self, config, submodules: EngramTransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.engram_layer_id = self.layer_number - 1  # megatron numbers layers globally from 1
        layer_ids = list(config.engram_layer_ids)
        if self.engram_layer_id not in layer_ids:
            raise ValueError(
                f"EngramTransformerLayer built for global layer {self.engram_layer_id}, which is not "
                f"in engram_layer_ids={layer_ids}: build it with engram_block_spec"
            )
        self.engram_slot = layer_ids.index(self.engram_layer_id)
        # (hash id block, pending lookup) set by EngramGPTModel's prefetch for one forward
        self.prefetched_lookup = None
        self.engram = build_module(
            submodules.engram,
            config=config,
            hidden_size=config.hidden_size,
            layer_id=self.engram_layer_id,
            embedding_parallel=engram_embedding_parallel(config, tp_group=self.pg_collection.tp),
            dtype=config.params_dtype,
            table_dtype=engram_table_dtype(config),
        )

    def engram_branch(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                      memory: torch.Tensor | None = None) -> torch.Tensor:
        """Engram output for this rank's hidden slice (``memory``: rows already fetched).

        With sequence parallelism the hidden states are split over TP along the sequence, but
        the short conv reads neighbouring positions: gather the full sequence (backward: take
        this rank's slice, since every TP rank computes the same branch), run Engram, keep
        this rank's slice.
        """
        ids = dict(hash_ids=hash_ids) if memory is None else dict(memory=memory)
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            tp = self.pg_collection.tp
            full = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=tp
            )
            return scatter_to_sequence_parallel_region(self._engram(full, ids), group=tp)
        return self._engram(hidden_states, ids)

    def _engram(self, hidden_states: torch.Tensor, ids: dict) -> torch.Tensor:
        """Engram on megatron's activation: ``[s, b, h]``, or with mHC the ``[s, b, n*h]``
        streams, which the branch reads and writes as ``[s, b, n, h]`` (hc_mult = n)."""
        streams = self.engram.hc_mult
        if streams == 1:
            return self.engram(hidden_states, **ids)
        output = self.engram(split_streams(hidden_states, streams), **ids)
        return output.reshape(hidden_states.shape)

    def issue_lookup(self, context: torch.Tensor):
        """Start this layer's lookup for the micro-batch's [L, B, S, K] block (prefetch)."""
        return self.engram.multi_head_embedding.issue(context[self.engram_slot].transpose(0, 1))

    def forward(self, hidden_states: torch.Tensor, *args, context: Optional[torch.Tensor] = None, **kwargs):
        if context is None:
            raise ValueError(
                f"Engram layer {self.engram_layer_id} got no hash ids: call EngramGPTModel with "
                "input_ids (or engram_hash_ids) on every pipeline stage"
            )
        memory = None
        prefetched = self.prefetched_lookup
        if prefetched is not None and _same_tensor(prefetched[0], context):
            memory = prefetched[1].wait()  # issued at the chunk's start; used once
            self.prefetched_lookup = None
        hash_ids = context[self.engram_slot].transpose(0, 1)  # [S, B, K], sequence first
        hidden_states = hidden_states + self.engram_branch(hidden_states, hash_ids, memory)
        output, _ = super().forward(hidden_states, *args, context=None, **kwargs)
        return output, context


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same ids block (megatron's recompute may hand the layer an alias of it)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride())


class EngramHyperConnectionLayer(EngramTransformerLayer, HyperConnectionTransformerLayer):
    """The Engram layer on the mHC backbone: ``X = X + Engram(X)`` on all n streams
    (hc_mult = n), then the layer's mHC sublayers (``HyperConnectionTransformerLayer``)."""
