"""EngramTransformerLayer: a megatron TransformerLayer with the Engram branch at its entry.

``h = h + Engram(h, hash_ids)``, then megatron's unchanged layer forward. The micro-batch's
hash ids arrive through the ``context`` argument that megatron's block already hands to every
layer (and saves with the inputs under full recompute, so a recomputed layer sees the same
ids); decoder-only GPT models leave that slot unused. The block is ``[L, B, S, K]``
(``models/engram_gpt.py``) and this layer reads its slice by its position in
``engram_layer_ids``. Under context or sequence parallelism the layer holds only some
positions of the sequence (zigzag chunks, its TP slice): it runs the branch on those, with the
conv's left context from a halo (``engram_train.parallel.context``).
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
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from engram_train.config import engram_table_dtype
from engram_train.models.hyper_connection_layer import (
    HyperConnectionTransformerLayer,
    split_streams,
)
from engram_train.parallel.context import sequence_halo
from engram_train.parallel.lookup import engram_embedding_parallel
from engram_train.errors import InputError


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
            raise InputError(
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
            embedding_parallel=engram_embedding_parallel(config, tp_group=self.pg_collection.tp,
                                                         sequence_parallel=config.sequence_parallel),
            dtype=config.params_dtype,
            table_dtype=engram_table_dtype(config),
        )
        # A split sequence (context parallel, or sequence parallel over TP): each rank runs the
        # branch on its own positions, the conv's left context comes from the halo. The V4.1
        # branch looks back nowhere (no conv): no halo; slice L of the block is its token mask.
        self.v41 = config.engram_variant == "deepseek_v41"
        self.engram_halo = None if self.v41 else sequence_halo(
            config, (config.engram_kernel_size - 1) * config.max_ngram_size,
            tp_group=self.pg_collection.tp, cp_group=getattr(self.pg_collection, "cp", None))
        self.sequence_split = bool(config.sequence_parallel) and self.pg_collection.tp.size() > 1
        if self.sequence_split:  # partial gradients per TP slice: megatron sums them over TP
            for name, param in self.engram.named_parameters():
                if not name.startswith("multi_head_embedding."):
                    param.sequence_parallel = True

    def engram_branch(self, hidden_states: torch.Tensor, hash_ids: torch.Tensor,
                      memory: torch.Tensor | None = None,
                      document_distance: torch.Tensor | None = None,
                      token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Engram output for this rank's hidden slice (``memory``: rows already fetched;
        ``document_distance`` [S, B]: the conv stops at document starts; ``token_mask`` [S, B]
        bool, V4.1: the branch adds nothing where False).

        Under context parallelism the rank holds its zigzag chunks, with sequence parallelism
        also only its TP slice of them: the branch runs on exactly these positions (their own
        ids, their own rows), and the conv takes the positions before each piece from the
        halo (``parallel/context.py``), so no TP rank repeats another's work.
        """
        ids = dict(hash_ids=hash_ids) if memory is None else dict(memory=memory)
        if document_distance is not None:
            ids["document_distance"] = document_distance
        if token_mask is not None:
            ids["token_mask"] = token_mask
        return self._engram(hidden_states, ids)

    def _engram(self, hidden_states: torch.Tensor, ids: dict) -> torch.Tensor:
        """Engram on megatron's activation: ``[s, b, h]``, or with mHC the ``[s, b, n*h]``
        streams, which the branch reads and writes as ``[s, b, n, h]`` (hc_mult = n)."""
        streams = self.engram.hc_mult
        if streams == 1:
            return self.engram(hidden_states, **ids, halo=self.engram_halo)
        output = self.engram(split_streams(hidden_states, streams), **ids, halo=self.engram_halo)
        return output.reshape(hidden_states.shape)

    def issue_lookup(self, context: torch.Tensor):
        """Start this layer's lookup for the micro-batch's [L, B, S, K] block (prefetch)."""
        return self.engram.issue_lookup(self._hash_ids(context))

    def _hash_ids(self, context: torch.Tensor) -> torch.Tensor:
        """This layer's ids [S, B, K] for the positions this rank holds (its TP slice under
        sequence parallelism; the block is already this CP rank's share)."""
        return self._held(context[self.engram_slot].transpose(0, 1))  # sequence first

    def _document_distance(self, context: torch.Tensor) -> torch.Tensor | None:
        """[S, B] document distances of the positions this rank holds, when the block carries
        them (slice L, ``engram_reset_at_eos``; the V4.1 variant: never), else None."""
        if self.v41 or context.shape[0] <= len(self.config.engram_layer_ids):
            return None
        return self._held(context[-1, :, :, 0].transpose(0, 1))

    def _token_mask(self, context: torch.Tensor) -> torch.Tensor | None:
        """[S, B] bool, False at dead tokens, of the positions this rank holds, when the block
        carries a token mask (slice L, the V4.1 variant with padding), else None."""
        if not self.v41 or context.shape[0] <= len(self.config.engram_layer_ids):
            return None
        return self._held(context[-1, :, :, 0].transpose(0, 1)) != 0

    def _held(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of a sequence-first tensor this rank holds (its TP slice under SP)."""
        if not self.sequence_split:
            return ids
        tp = self.pg_collection.tp
        width = ids.shape[0] // tp.size()
        return ids[tp.rank() * width : (tp.rank() + 1) * width]

    def forward(self, hidden_states: torch.Tensor, *args, context: Optional[torch.Tensor] = None, **kwargs):
        if context is None:
            raise InputError(
                f"Engram layer {self.engram_layer_id} got no hash ids: call EngramGPTModel with "
                "input_ids (or engram_hash_ids) on every pipeline stage"
            )
        memory = None
        prefetched = self.prefetched_lookup
        if prefetched is not None and _same_tensor(prefetched[0], context):
            memory = prefetched[1].wait()  # issued at the chunk's start; used once
            self.prefetched_lookup = None
        hash_ids = self._hash_ids(context)  # [S, B, K], sequence first
        hidden_states = hidden_states + self.engram_branch(
            hidden_states, hash_ids, memory, self._document_distance(context),
            self._token_mask(context))
        output, _ = super().forward(hidden_states, *args, context=None, **kwargs)
        return output, context


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same ids block (megatron's recompute may hand the layer an alias of it)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride())


class EngramHyperConnectionLayer(EngramTransformerLayer, HyperConnectionTransformerLayer):
    """The Engram layer on the mHC backbone: ``X = X + Engram(X)`` on all n streams
    (hc_mult = n), then the layer's mHC sublayers (``HyperConnectionTransformerLayer``)."""
