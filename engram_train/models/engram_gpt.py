"""EngramGPTModel: megatron's GPTModel whose Engram layers receive the micro-batch's hash ids.

One route for hash ids, from the hasher to the layers: one int64 block ``[L, B, S, K]`` per
micro-batch (L = Engram layers in ``engram_layer_ids`` order, K = (N-1) x H), as
``NgramHashMapping.hash_stacked`` returns it. The data path hashes it on a CPU thread and the
step copies it to the device once (``engram_hash_ids``); a caller that feeds plain
``input_ids`` gets the same block hashed here. The block travels to the layers through
megatron's own decoder kwargs: ``GPTModel.forward(extra_block_kwargs={"context": block})`` ->
``TransformerBlock.forward(context=...)`` -> every layer's ``context`` (saved with the layer
inputs under full recompute, so a recomputed layer sees its own micro-batch's ids). Engram
layers read their slice; plain GPT layers pass the slot through untouched. Every pipeline stage
takes the batch (middle stages need the ids for their Engram layers). Tracks megatron-core
0.16.1 (``GPTModel.forward(..., extra_block_kwargs=...)``).

Prefetch (``engram_prefetch``): ids depend on tokens only, so before the chunk's forward runs,
every Engram layer of the chunk starts its lookup (ids to owners, rows back asynchronously);
each layer waits for its rows when it runs, so the exchange overlaps the embedding and the
layers before it. A layer re-run by full recompute looks up again (the table has not changed
within the step: same rows).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from engram_train.config import uses_engram
from engram_train.errors import ConfigError, InputError


def check_hash_ids(hash_ids: torch.Tensor, layer_ids: list[int], documents: bool = False
                   ) -> torch.Tensor:
    """The ``[L, B, S, K]`` int64 block, checked (one slice per Engram layer; with
    ``documents`` it may carry one more slice L: the paper variant's document distances
    (``engram_reset_at_eos``) or the V4.1 variant's token mask, ``hash_block``)."""
    slices = (len(layer_ids), len(layer_ids) + 1) if documents else (len(layer_ids),)
    if hash_ids.ndim != 4 or hash_ids.shape[0] not in slices:
        raise InputError(
            f"engram_hash_ids must be [{' or '.join(map(str, slices))}, B, S, K] (one slice per "
            f"Engram layer, as NgramHashMapping.hash_block returns), got {tuple(hash_ids.shape)}"
        )
    if hash_ids.dtype != torch.int64:
        raise InputError(f"engram_hash_ids must be int64, got {hash_ids.dtype}")
    return hash_ids


class EngramGPTModel(GPTModel):
    """GPTModel whose Engram layers receive per-micro-batch hash ids (module docstring)."""

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        # The Engram rules themselves ran when the config was built (engram_train.config).
        if not uses_engram(config):
            raise ConfigError(
                "EngramGPTModel needs use_engram=True; build megatron's GPTModel otherwise"
            )
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        self._hash_mapping = None

    @property
    def hash_mapping(self):
        """Built on first use: only needed when the batch carries no precomputed hash ids."""
        if self._hash_mapping is None:
            from engram_train.engram.variant import build_hash_mapping

            if not self.config.engram_tokenizer_name_or_path:
                raise ConfigError(
                    "the batch has no engram_hash_ids and engram_tokenizer_name_or_path is unset: "
                    "set it (model.engram_tokenizer_name_or_path) or hash in the data path"
                )
            self._hash_mapping = build_hash_mapping(self.config)
        return self._hash_mapping

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *args,
        engram_hash_ids: torch.Tensor | None = None,
        engram_token_mask: torch.Tensor | None = None,
        extra_block_kwargs: dict | None = None,
        **kwargs,
    ):
        """``engram_token_mask`` [B, S] bool (``engram_variant=deepseek_v41``): False marks a
        dead token (padding): its n-grams stop there and its Engram branches add nothing; the
        block then carries it as slice L (``hash_block(ids, token_mask)`` gives the same)."""
        layer_ids = list(self.config.engram_layer_ids)
        v41 = self.config.engram_variant == "deepseek_v41"
        if engram_token_mask is not None and not v41:
            raise InputError("engram_token_mask applies to engram_variant=deepseek_v41; the "
                             "paper variant has no dead tokens")
        if engram_hash_ids is None:
            if input_ids is None:
                raise InputError(
                    "EngramGPTModel needs input_ids or engram_hash_ids on every pipeline stage"
                )
            if self.config.context_parallel_size > 1:
                raise InputError(
                    "context_parallel_size > 1 needs engram_hash_ids from the data path: n-grams "
                    "at a chunk's first positions need the tokens of the chunk before it, so the "
                    "ids are hashed on the whole sequence and split with the tokens "
                    "(engram_train.parallel.context.context_parallel_batch)"
                )
            engram_hash_ids = (self.hash_mapping.hash_block(input_ids, engram_token_mask) if v41
                               else self.hash_mapping.hash_block(input_ids))  # one copy back
        # slice L: the paper's document distances (engram_reset_at_eos), V4.1's token mask
        documents = v41 or bool(self.config.engram_reset_at_eos)
        block = check_hash_ids(engram_hash_ids, layer_ids, documents)
        if v41 and engram_token_mask is not None and block.shape[0] == len(layer_ids):
            from engram_train.engram.v41_ngram_hash import with_token_mask

            block = with_token_mask(block, engram_token_mask)  # ids hashed with it (docstring)
        elif not v41 and documents and block.shape[0] == len(layer_ids):
            block = self._with_documents(block, input_ids)
        if input_ids is not None and tuple(block.shape[1:3]) != tuple(input_ids.shape):
            raise InputError(
                f"engram_hash_ids {tuple(block.shape)} do not match input_ids "
                f"{tuple(input_ids.shape)}: expected [{len(layer_ids)}, B, S, K]"
            )
        extra_block_kwargs = dict(extra_block_kwargs or {})
        if extra_block_kwargs.get("context") is not None:
            raise InputError("Engram models use the decoder's context slot for hash ids; "
                             "cross-attention context is not supported with Engram")
        extra_block_kwargs["context"] = block
        layers = self._engram_layers() if self.config.engram_prefetch else []
        for layer in layers:  # every lookup starts now, in layer order on every rank
            layer.prefetched_lookup = (block, layer.issue_lookup(block))
        pending = [layer.prefetched_lookup[1] for layer in layers]
        while any([p.advance() for p in pending]):  # their id exchanges overlap, in turns
            pass
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   extra_block_kwargs=extra_block_kwargs, **kwargs)
        finally:
            for layer in layers:  # a recomputed layer (full recompute) looks up again
                layer.prefetched_lookup = None

    def _with_documents(self, block: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """The hash ids plus the document slice computed here from ``input_ids`` (the whole
        sequence; under context parallelism the data path must supply it)."""
        if input_ids is None or self.config.context_parallel_size > 1:
            raise InputError(
                "engram_reset_at_eos needs each position's document start for the short conv: "
                "pass engram_hash_ids from NgramHashMapping.hash_block (the data path does), not "
                "hash_stacked"
            )
        from engram_train.engram.ngram_hash import document_distance

        distance = document_distance(input_ids.detach().cpu().numpy(), self.hash_mapping.eos_id)
        extra = torch.from_numpy(distance).to(block.device)[None, ..., None]
        return torch.cat([block, extra.expand(1, *block.shape[1:])])

    def _engram_layers(self) -> list:
        from engram_train.models.engram_layer import EngramTransformerLayer

        return [m for m in self.decoder.layers if isinstance(m, EngramTransformerLayer)]
