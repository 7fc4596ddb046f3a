"""One DeepSeek-V4.1 layer in plain torch: the Engram branch (on its layers), then the
attention and the MoE sublayers, each between single-pass mHC coefficients.

``forward(streams, pre, state)`` with the streams ``[s, b, n, h]``, the ``pre`` the previous
sublayer handed over (`v41_hyper_connection.first_pre` before layer 0) and the `CSAState` the
previous layer returned; it returns the three for the next layer. After the last layer the
model collapses the streams with the returned ``pre`` (`v41_hyper_connection.collapse`) and
applies its final RMSNorm. Per layer::

    X     = X + engram(X)                                  # Engram layers only
    a     = attn_hc(X);  X = expand(attn(attn_norm(collapse(X, pre))), X, a)
    f     = ffn_hc(X);   X = expand(ffn(ffn_norm(collapse(X, a.pre))), X, f)
    pre   = f.pre

`v41_model.DeepseekV41GPTModel` runs these layers, handing each the previous one's outputs;
the blocks are checked against NeMo as a stack (tests/test_deepseek_v41_blocks.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engram_train.errors import InputError
from engram_train.models.deepseek_v41.v41_attention import (
    DeepseekV41Attention,
    tensor_parallel_rank,
)
from engram_train.models.deepseek_v41.v41_csa import CSAState
from engram_train.models.deepseek_v41.v41_hyper_connection import (
    DeepseekV41HyperConnection,
    collapse,
    expand,
    recomputed,
)
from engram_train.models.deepseek_v41.v41_moe import DeepseekV41MoE
from engram_train.models.deepseek_v41.v41_primitives import DeepseekV41RMSNorm


class DeepseekV41Layer(nn.Module):
    """Layer `layer_id` of the backbone (module docstring). `engram`, when given, is the
    layer's ``engram.v41_engram_module.DeepseekV41Engram`` (its hash ids go to forward);
    `recompute` the selective recompute's modules (``v41_config.selective_recompute``)."""

    def __init__(self, args, layer_id: int, config, tp_group=None, engram: nn.Module | None = None,
                 device=None, dtype: torch.dtype | None = None,
                 recompute: frozenset[str] = frozenset()):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.layer_id = int(layer_id)
        self.engram = engram
        self.recompute_moe = "moe" in recompute
        hc = dict(hidden_size=args.hidden_size, hc_mult=args.hc_mult,
                  sinkhorn_iters=args.hc_sinkhorn_iters, hc_eps=args.hc_eps,
                  norm_eps=args.rms_norm_eps, init_std=args.initializer_range, device=device)
        self.attn_hc = DeepseekV41HyperConnection(**hc)
        self.attn_norm = DeepseekV41RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)
        self.attn = DeepseekV41Attention(args, layer_id, config, tp_group, **factory,
                                         recompute_core_attention="core_attn" in recompute)
        self.ffn_hc = DeepseekV41HyperConnection(**hc)
        self.ffn_norm = DeepseekV41RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)
        self.ffn = DeepseekV41MoE(args, config, tp_group, **factory)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, state: CSAState | None = None,
                valid: torch.Tensor | None = None, hash_ids: torch.Tensor | None = None,
                documents: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, CSAState]:
        """`streams` ``[s, b, n, h]``, `pre` float32 ``[s, b, n]``, `valid` optional bool
        ``[s, b]`` (right padding), `hash_ids` ``[s, b, K]`` on an Engram layer, `documents`
        optional ``[s, b]`` packed document ids of the whole sequence (`v41_documents`).
        Under sequence parallelism `streams`, `pre` and `hash_ids` are this tensor-parallel
        rank's slice of the sequence, `valid` and `documents` the whole sequence (the attention
        gathers the sequence; the Engram branch and the MoE take `valid`'s slice)."""
        if pre.dtype != torch.float32 or pre.shape != streams.shape[:-1]:
            raise InputError(f"pre must be float32 {tuple(streams.shape[:-1])}, got "
                             f"{pre.dtype} {tuple(pre.shape)}.")
        local = self._local_valid(valid, streams.shape[0])
        if self.engram is not None:
            if hash_ids is None:
                raise InputError(f"layer {self.layer_id} has an Engram branch: pass its hash_ids.")
            streams = streams + self.engram(streams, hash_ids, token_mask=local)
        mix = self.attn_hc(streams)
        attended, state = self.attn(self.attn_norm(collapse(streams, pre)), state, valid,
                                    documents)
        streams = expand(attended, streams, mix)
        pre = mix.pre
        mix = self.ffn_hc(streams)
        normed = self.ffn_norm(collapse(streams, pre))
        moe_out = recomputed(self.ffn, normed, local) if self.recompute_moe else self.ffn(
            normed, local)
        return expand(moe_out, streams, mix), mix.pre, state

    def _local_valid(self, valid: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """`valid` ``[s, b]`` of the whole sequence -> this rank's ``rows`` of it: all of it
        without tensor parallelism, else the tensor-parallel rank's contiguous share (megatron's
        sequence-parallel split)."""
        if valid is None or valid.shape[0] == rows:
            return valid
        tp = self.attn.tp
        if valid.shape[0] != rows * tp:
            raise InputError(f"valid has {valid.shape[0]} rows: the whole sequence of "
                             f"{rows} x {tp} tensor-parallel ranks ([s, b] bool).")
        rank = tensor_parallel_rank(self.attn.tp_group)
        return valid[rank * rows:(rank + 1) * rows]
