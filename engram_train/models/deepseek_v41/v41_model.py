"""DeepSeek-V4.1 as a megatron-core language model: `DeepseekV41GPTModel`, which the builder
builds for ``model_family: deepseek_v41`` and megatron's schedules drive as they drive
``GPTModel`` (``training/step.py``: the same forward arguments, the same per-token loss).

Forward, sequence-first as megatron (``[s, b, h]``; mHC streams ``[s, b, n, h]``)::

    x      = embedding(input_ids)                        # megatron's VocabParallelEmbedding
    X      = x broadcast to hc_mult streams;  pre = stream 0 alone (float32)
    state  = CSAState()
    for each layer:  X, pre, state = layer(X, pre, state, hash_ids of its Engram)
    logits = output_layer(norm(collapse(X, pre)).float())   # float32 weight
    loss   = vocab-parallel cross entropy(logits, labels)   # megatron's LanguageModule

What one layer hands the next is explicit: the streams, the float32 ``pre`` (single-pass mHC)
and the CSA2 state (compressed KV, index keys, selection, candidates), never stored on a
module. The layers are `v41_layer.DeepseekV41Layer` (exact against NeMo Automodel's blocks).

Positions are the token's index in its row (V4.1's attention is causal by construction; the
sliding window and CSA2 give its mask): ``position_ids`` and megatron's ``attention_mask`` are
accepted and not read (``data.reset_position_ids=true`` is refused for V4.1 by the run config).
``padding_mask`` ``[b, s]`` (megatron's ``GPTModel`` convention: True marks padding) marks
right padding: padding tokens are neither keys nor compressed runs, enter no routed expert and
no Engram lookup, so the other tokens' outputs are those of the row without them
(``engram-logits`` pads a row to a multiple of the tensor-parallel size this way).

Data-parallel, the heads over tensor-parallel ranks with sequence parallelism (the attention
gathers the sequence; `_mark_sequence_parallel`), the routed experts over expert-parallel ranks
(``v41_expert_parallel.py``), the Engram tables over embedding-parallel ranks (the trainer's
lookup method, ``parallel/lookup.py``; the checkpoint view in ``v41_sharding.py``), the layers
over pipeline stages (each stage its even share; what a layer hands the next crosses the
boundary whole, ``v41_pipeline.py``). Recompute: ``full`` re-runs chunks of layers in the
backward (`full_recompute_chunks`), ``selective`` the modules of ``recompute_modules``
(``v41_config.selective_recompute``). Context parallelism: ``v41_context_parallel.py``; a
virtual pipeline is refused when the run config is checked (``training/run_config.py``).

Under bf16 the float32 parts keep their dtype (``keep_fp32``, held out of ``Float16Module``'s
cast by the builder): the mHC mappings (``attn_hc``/``ffn_hc``), the attention sinks and the
output layer, the compressors' ``wkv``/``wgate``, as NeMo's ``_keep_in_fp32_modules_strict``. The
router's ``e_score_correction_bias`` is a float32 buffer that stays float32 under
``Float16Module``'s cast (``v41_moe.DeepseekV41Router._apply``), as NeMo keeps it, so bf16
routing picks the experts float32 routing picks on the same scores.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from torch import nn
from torch.utils.checkpoint import checkpoint

from engram_train.config import uses_engram
from engram_train.engram.v41_ngram_hash import document_ids
from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_context_parallel import context_share, whole_sequence_ids
from engram_train.models.deepseek_v41.v41_csa import CSAState
from engram_train.models.deepseek_v41.v41_hyper_connection import collapse, first_pre
from engram_train.models.deepseek_v41.v41_config import selective_recompute
from engram_train.models.deepseek_v41.v41_layer import DeepseekV41Layer
from engram_train.models.deepseek_v41.v41_pipeline import (
    pack_boundary,
    stage_layer_ids,
    unpack_boundary,
)
from engram_train.models.deepseek_v41.v41_primitives import DeepseekV41RMSNorm
from engram_train.models.deepseek_v41.v41_sharding import DeepseekV41Layers


def _engram_branch(config, layer_id: int) -> nn.Module | None:
    """Layer `layer_id`'s V4.1 Engram branch when Engram is on there (``engram_variant``
    must be ``deepseek_v41``)."""
    if not uses_engram(config) or layer_id not in config.engram_layer_ids:
        return None
    from engram_train.engram.variant import engram_branch_class, is_v41

    if not is_v41(config):
        raise ConfigError("model_family=deepseek_v41 with use_engram=true takes "
                          "engram_variant=deepseek_v41 (the paper branch has no V4.1 layer).")
    options = {}
    if parallel_state.model_parallel_is_initialized():  # the trainer's tables: sharded over eps
        from engram_train.parallel.lookup import engram_embedding_parallel

        options["embedding_parallel"] = engram_embedding_parallel(
            config, sequence_parallel=config.sequence_parallel)
    return engram_branch_class(config)(config, config.hidden_size, layer_id, **options)


class DeepseekV41GPTModel(LanguageModule):
    """The V4.1 language model of one pipeline stage (module docstring): the embedding on the
    first (`pre_process`), the stage's layers (``v41_pipeline.stage_layer_ids``), the final
    collapse, norm and output layer on the last (`post_process`). Arguments as megatron's
    ``GPTModel`` takes them from the builder; `config` is a
    ``models.deepseek_v41.v41_config.DeepseekV41ModelConfig``."""

    def __init__(self, config, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = "rope", vp_stage: int | None = None) -> None:
        super().__init__(config=config)
        if share_embeddings_and_output_weights:
            raise ConfigError("DeepSeek-V4.1 has an untied output layer.")
        del position_embedding_type  # V4.1's RoPE lives in its attention
        args = self.args = config.deepseek_v41
        self.pre_process, self.post_process = bool(pre_process), bool(post_process)
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.vocab_size, self.max_sequence_length = int(vocab_size), int(max_sequence_length)
        self.vp_stage, self.input_tensor = vp_stage, None
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type="rope")
        dtype, selective = config.params_dtype, selective_recompute(config)
        self.layers = DeepseekV41Layers(
            DeepseekV41Layer(args, i, config, engram=_engram_branch(config, i), dtype=dtype,
                             recompute=selective)
            for i in stage_layer_ids(args.num_hidden_layers, vp_stage))
        if self.post_process:
            self.final_norm = DeepseekV41RMSNorm(args.hidden_size, args.rms_norm_eps,
                                                 dtype=dtype)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                args.hidden_size, vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=False)
            self.output_layer.weight.data = self.output_layer.weight.data.float()
        self._mark_float32()
        self._mark_sequence_parallel()
        self.setup_embeddings_and_output_layer()

    def _mark_float32(self) -> None:
        """The parameters that stay float32 under bf16 (module docstring)."""
        for name, param in self.named_parameters():
            if param.dtype == torch.float32 and (
                    ".attn_hc." in name or ".ffn_hc." in name or name.endswith(".attn_sink")
                    or ".attn.compressor.w" in name or name.startswith("output_layer.")):
                param.keep_fp32 = True

    def _mark_sequence_parallel(self) -> None:
        """Under TP (with sequence parallelism) every parameter that is not TP-split gets a
        partial gradient on each TP rank (its sequence slice, or its heads' share of the shared
        KV, query latent and compressed branch): megatron sums those over TP
        (``sequence_parallel``), the Engram table excepted (its lookup reduces its rows)."""
        if not (self.config.sequence_parallel and parallel_state.model_parallel_is_initialized()
                and parallel_state.get_tensor_model_parallel_world_size() > 1):
            return
        for name, param in self.named_parameters():
            if not getattr(param, "tensor_model_parallel", False) \
                    and not name.endswith("multi_head_embedding.weight"):
                param.sequence_parallel = True

    def set_input_tensor(self, input_tensor) -> None:
        """megatron's schedules call it on every stage before the forward: after the first
        stage, the previous stage's boundary tensor (``v41_pipeline``)."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        self.input_tensor = input_tensor

    def _layer_hash_ids(self, engram_hash_ids, layer: DeepseekV41Layer):
        """``[s, b, K]`` hash ids of `layer`'s Engram (None without one): from the micro-batch's
        ``[L, B, S, K]`` block (L in ``engram_layer_ids`` order) or ``{layer_id: [B, S, K]}``."""
        if layer.engram is None:
            return None
        if engram_hash_ids is None:
            raise InputError(f"layer {layer.layer_id} has an Engram branch: the batch needs "
                             "engram_hash_ids.")
        if isinstance(engram_hash_ids, dict):
            ids = engram_hash_ids[layer.layer_id]
        else:
            layer_ids = list(self.config.engram_layer_ids)
            if len(engram_hash_ids) != len(layer_ids):  # a token-mask slice: not supported yet
                raise InputError(f"the hash block has {len(engram_hash_ids)} slices for "
                                 f"engram_layer_ids={layer_ids}: one per Engram layer.")
            ids = engram_hash_ids[layer_ids.index(layer.layer_id)]
        ids = torch.as_tensor(ids, device=layer.attn_hc.fn.device).transpose(0, 1)
        if self.config.sequence_parallel:  # this TP rank's sequence slice
            tp = parallel_state.get_tensor_model_parallel_world_size()
            share = ids.shape[0] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            ids = ids[rank * share:(rank + 1) * share]
        return ids

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                engram_hash_ids=None, padding_mask: torch.Tensor | None = None,
                **unused) -> torch.Tensor:
        """``input_ids [b, s]`` -> logits ``[b, s, vocab / tp]`` float32, or with `labels`
        ``[b, s]`` the per-token loss ``[b, s]`` (megatron's ``GPTModel`` contract); before
        the last pipeline stage, the boundary tensor for the next (``v41_pipeline``).
        `padding_mask` ``[b, s]`` bool, True on right padding (module docstring)."""
        del position_ids, attention_mask
        given = sorted(k for k, v in unused.items() if v is not None)
        if given:  # e.g. engram_token_mask: dead tokens are not supported by this model yet
            raise InputError(f"DeepseekV41GPTModel.forward does not take {given} yet.")
        if self.pre_process:
            x = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            streams = x.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1)
            pre, state = first_pre(streams), CSAState()
        else:
            streams, pre, state = unpack_boundary(self.input_tensor)
        documents = None
        if self.args.document_eos_id is not None:  # packed documents (v41_documents)
            share = context_share(input_ids.shape[1], input_ids.device)
            whole = input_ids if share is None else whole_sequence_ids(input_ids, share)
            documents = document_ids(whole, self.args.document_eos_id).t()
        valid = right_padding_valid(padding_mask, input_ids)
        streams, pre, state = self._layers_forward(streams, pre, state, engram_hash_ids,
                                                   documents, valid)
        if not self.post_process:
            return pack_boundary(streams, pre, state, self.args.hidden_size)
        hidden = self.final_norm(collapse(streams, pre))
        logits, _ = self.output_layer(hidden.float())
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def _layers_forward(self, streams, pre, state, engram_hash_ids, documents=None,
                        valid=None):
        """This stage's layers; under ``recompute_granularity=full`` the chunks of
        `full_recompute_chunks` keep only their inputs and run again in the backward."""
        layers = list(self.layers)
        hash_ids = [self._layer_hash_ids(engram_hash_ids, layer) for layer in layers]
        for start, stop, recompute in full_recompute_chunks(self.config, len(layers)):
            run = functools.partial(_run_layers, layers[start:stop], hash_ids[start:stop],
                                    documents, valid)
            if recompute and torch.is_grad_enabled():
                streams, pre, state = checkpoint(run, streams, pre, state, use_reentrant=False)
            else:
                streams, pre, state = run(streams, pre, state)
        return streams, pre, state


def _run_layers(layers, hash_ids, documents, valid, streams, pre, state):
    for layer, ids in zip(layers, hash_ids):
        streams, pre, state = layer(streams, pre, state, valid=valid, hash_ids=ids,
                                    documents=documents)
    return streams, pre, state


def right_padding_valid(padding_mask: torch.Tensor | None, input_ids: torch.Tensor
                        ) -> torch.Tensor | None:
    """``valid [s, b]`` bool of the whole sequence from megatron's ``padding_mask [b, s]``
    (True on padding), or None without padding; `InputError` unless every row is its tokens
    followed by its padding, at least one token."""
    if padding_mask is None:
        return None
    if padding_mask.dtype != torch.bool or padding_mask.shape != input_ids.shape:
        raise InputError(f"padding_mask must be bool [b, s] = {list(input_ids.shape)} (True on "
                         f"padding), got {padding_mask.dtype} {list(padding_mask.shape)}.")
    if not bool(padding_mask.any()):
        return None
    valid = ~padding_mask.to(input_ids.device)
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()) or not bool(valid[:, 0].all()):
        raise InputError("padding_mask: DeepSeek-V4.1 takes right padding only (each row its "
                         "tokens, at least one, then its padding).")
    return valid.t().contiguous()


def full_recompute_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """``(start, stop, recompute)`` over a stage's `num_layers` layers, as megatron's
    ``TransformerBlock._checkpointed_forward`` chunks them (megatron-core 0.16.1 / 0.19.2):
    ``uniform``, every run of ``recompute_num_layers`` layers recomputed as one; ``block``,
    the first ``recompute_num_layers`` layers each recomputed, the others not. torch's
    non-reentrant checkpoint (which takes the CSA2 state as it is) in place of megatron's
    reentrant one (tensors only); V4.1 has no dropout outside its attention, whose random
    state torch's checkpoint restores."""
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    size = int(config.recompute_num_layers)
    if config.recompute_method == "uniform":
        return [(i, min(i + size, num_layers), True) for i in range(0, num_layers, size)]
    return [(i, i + 1, i < size) for i in range(num_layers)]
