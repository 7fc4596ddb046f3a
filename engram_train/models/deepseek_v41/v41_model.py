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

Data-parallel, the heads over tensor-parallel ranks with sequence parallelism (the attention
gathers the sequence; `_mark_sequence_parallel`), the routed experts over expert-parallel ranks
(``v41_expert_parallel.py``), the Engram tables over embedding-parallel ranks (the trainer's
lookup method, ``parallel/lookup.py``; the checkpoint view in ``v41_sharding.py``); pipeline
and context parallelism and TP together with EP are refused when the run config is checked
(``training/run_config.py``): the CSA2 state does not cross pipeline stages yet.

Under bf16 the float32 parts keep their dtype (``keep_fp32``, held out of ``Float16Module``'s
cast by the builder): the mHC mappings (``attn_hc``/``ffn_hc``), the attention sinks and the
output layer, the compressors' ``wkv``/``wgate``, as NeMo's ``_keep_in_fp32_modules_strict``. The
router's ``e_score_correction_bias`` is a buffer, which ``Float16Module`` casts to bf16 (NeMo
keeps it float32): a difference under bf16 only.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from torch import nn

from engram_train.config import uses_engram
from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_csa import CSAState
from engram_train.models.deepseek_v41.v41_hyper_connection import collapse, first_pre
from engram_train.models.deepseek_v41.v41_layer import DeepseekV41Layer
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
    """The V4.1 language model of one process (module docstring). Arguments as megatron's
    ``GPTModel`` takes them from the builder; `config` is a
    ``models.deepseek_v41.v41_config.DeepseekV41ModelConfig``."""

    def __init__(self, config, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: str = "rope", vp_stage: int | None = None) -> None:
        super().__init__(config=config)
        if not (pre_process and post_process) or vp_stage not in (None, 0):
            raise ConfigError("model_family=deepseek_v41 runs one pipeline stage for now "
                              "(pipeline_model_parallel_size=1).")
        if share_embeddings_and_output_weights:
            raise ConfigError("DeepSeek-V4.1 has an untied output layer.")
        del position_embedding_type  # V4.1's RoPE lives in its attention
        args = self.args = config.deepseek_v41
        self.pre_process = self.post_process = True
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.vocab_size, self.max_sequence_length = int(vocab_size), int(max_sequence_length)
        self.vp_stage = vp_stage
        self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                position_embedding_type="rope")
        dtype = config.params_dtype
        self.layers = DeepseekV41Layers(
            DeepseekV41Layer(args, i, config, engram=_engram_branch(config, i), dtype=dtype)
            for i in range(args.num_hidden_layers))
        self.final_norm = DeepseekV41RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)
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
        """megatron's schedules call it on every stage; one stage takes no input tensor."""
        del input_tensor

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
        ids = torch.as_tensor(ids, device=self.output_layer.weight.device).transpose(0, 1)
        if self.config.sequence_parallel:  # this TP rank's sequence slice
            tp = parallel_state.get_tensor_model_parallel_world_size()
            share = ids.shape[0] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            ids = ids[rank * share:(rank + 1) * share]
        return ids

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                engram_hash_ids=None, **unused) -> torch.Tensor:
        """``input_ids [b, s]`` -> logits ``[b, s, vocab / tp]`` float32, or with `labels`
        ``[b, s]`` the per-token loss ``[b, s]`` (megatron's ``GPTModel`` contract)."""
        del position_ids, attention_mask
        given = sorted(k for k, v in unused.items() if v is not None)
        if given:  # e.g. engram_token_mask: dead tokens are not supported by this model yet
            raise InputError(f"DeepseekV41GPTModel.forward does not take {given} yet.")
        x = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
        n = self.args.hc_mult
        streams = x.unsqueeze(2).expand(-1, -1, n, -1)
        pre, state = first_pre(streams), CSAState()
        for layer in self.layers:
            streams, pre, state = layer(streams, pre, state,
                                        hash_ids=self._layer_hash_ids(engram_hash_ids, layer))
        hidden = self.final_norm(collapse(streams, pre))
        logits, _ = self.output_layer(hidden.float())
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)
