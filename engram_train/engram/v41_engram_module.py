"""DeepSeek-V4.1's Engram branch: the paper's memory lookup with V4.1's fused projection and gate.

Against the paper module (`engram_module.py`): no short conv, no projection biases, one fused
projection ``wkv`` giving one key per mHC stream and one value shared by the streams, and the
gate's two RMS norms reduced to one weight ``q_weight * k_weight`` per stream, epsilon
``rms_norm_eps`` (1e-20). Per stream g and position::

    key_g, value = split(wkv(memory))
    dot_g = <h_g * q_weight_g * k_weight_g, key_g> / (rms(h_g) * rms(key_g) * sqrt(d))
    gate_g = sigmoid(copysign(sqrt(max(|dot_g|, 1e-6)), dot_g))
    y_g = gate_g * value

The gate runs in float32 whatever the parameters' dtype. Every operation is per position, so
hidden states take any leading dims: ``[*, G, d]`` (``[*, d]`` when G == 1) with hash ids
``[*, K]`` head-local, as `DeepseekV41NgramHashMapping` gives them; a sequence split over
ranks needs no halo. The module returns y only (the caller adds the residual, as with the
paper module). Within 1e-6 in float32 of NeMo Automodel 0.7.0's ``DeepseekV41Engram``, forward
and every parameter's gradient (tests/test_deepseek_v41_engram.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engram_train.engram.engram_module import Engram
from engram_train.errors import ConfigError, InputError

GATE_SCORE_FLOOR = 1e-6  # |dot| floor under the gate's signed square root


class DeepseekV41Engram(nn.Module):
    """Engram branch of global layer `layer_id` in V4.1's form (module docstring).

    `args` is a ``DeepseekV41EngramArgs``; `hidden_size` the backbone's width d (one stream).
    Table options as the paper module: `row_start`/`row_end` or `embedding_parallel` pick the
    rows this rank holds, `seed` keys the partition-invariant table init, `table_dtype` and
    `placement` ('device' or 'host') the table's storage, `table` a ready lookup instead.
    `dtype` is the dtype of ``wkv`` and the gate weights.
    """

    def __init__(
        self,
        args,
        hidden_size: int,
        layer_id: int,
        *,
        seed: int = 0,
        row_start: int = 0,
        row_end: int | None = None,
        embedding_parallel=None,
        placement: str = "device",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        table_dtype: torch.dtype | None = None,
        table: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if layer_id not in args.engram_layer_ids:
            raise ConfigError(
                f"layer_id={layer_id} is not in engram_layer_ids={list(args.engram_layer_ids)}: "
                "add it there (the table sizes depend on the whole list)."
            )
        self.layer_id = int(layer_id)
        self.hidden_size = int(hidden_size)
        self.hc_mult = int(args.hc_mult)
        self.num_heads = args.num_hash_heads
        self.head_dim = int(args.engram_head_dim)
        self.memory_dim = self.num_heads * self.head_dim
        self.eps = float(args.rms_norm_eps)
        self.init_std = float(args.initializer_range)
        if self.hidden_size < 1:
            raise InputError(f"hidden_size={hidden_size} must be >= 1.")
        self.multi_head_embedding = table if table is not None else self._table(
            args, seed, row_start, row_end, embedding_parallel, placement, device,
            dtype if table_dtype is None else table_dtype)
        g, d = self.hc_mult, self.hidden_size
        self.wkv = nn.Linear(self.memory_dim, (g + 1) * d, bias=False, device=device, dtype=dtype)
        self.q_weight = nn.Parameter(torch.empty(g, d, device=device, dtype=dtype))
        self.k_weight = nn.Parameter(torch.empty(g, d, device=device, dtype=dtype))
        self.reset_parameters(include_table=False)  # the table initialized itself
        if table is None:
            from engram_train.engram.tables import mark_engram_param

            for param in self.parameters():
                mark_engram_param(param)

    def _table(self, args, seed, row_start, row_end, embedding_parallel, placement, device,
               table_dtype):
        """``MultiHeadEmbedding`` over the layer's head primes (V4.1's prime walk)."""
        from engram_train.engram.ngram_hash import engram_head_vocab_sizes
        from engram_train.engram.tables import MultiHeadEmbedding

        n = args.engram_max_ngram_size
        head_sizes = engram_head_vocab_sizes(
            [args.engram_vocab_size] * (n - 1), n, args.engram_n_heads, args.engram_layer_ids
        )[self.layer_id]
        primes = [p for order in head_sizes for p in order]
        if args.engram_num_embeddings is not None:
            rows = args.engram_num_embeddings[list(args.engram_layer_ids).index(self.layer_id)]
            if rows != sum(primes):
                raise ConfigError(
                    f"engram_num_embeddings gives layer {self.layer_id} {rows} rows; its hash "
                    f"heads address exactly {sum(primes)} (the sum of its primes)."
                )
        return MultiHeadEmbedding(
            primes, self.head_dim, layer_id=self.layer_id, seed=seed, init_std=self.init_std,
            row_start=row_start, row_end=row_end, parallel=embedding_parallel, device=device,
            dtype=table_dtype if table_dtype is not None else torch.float32, placement=placement,
        )

    @torch.no_grad()
    def reset_parameters(self, include_table: bool = True) -> None:
        """``wkv`` ~ N(0, initializer_range^2), the gate weights at one."""
        self.wkv.weight.normal_(0.0, self.init_std)
        self.q_weight.fill_(1.0)
        self.k_weight.fill_(1.0)
        if include_table:
            self.multi_head_embedding.reset_parameters()

    # The table's lookup is the paper module's.
    lookup = Engram.lookup
    issue_lookup = Engram.issue_lookup

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron dist_checkpointing view: the paper module's (the table row-sharded, every
        child replicated) plus the gate weights, parameters of this module itself."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        from engram_train.engram.tables import _tensor_parallel_group

        state = Engram.sharded_state_dict(self, prefix, sharded_offsets, metadata)
        own = nn.Module()  # holds the same Parameter objects (the optimizer maps by identity)
        for name, param in self.named_parameters(recurse=False):
            own.register_parameter(name, param)
        state.update(sharded_state_dict_default(own, prefix, sharded_offsets, metadata,
                                                tp_group=_tensor_parallel_group()))
        return state

    def forward(
        self,
        hidden_states: torch.Tensor,
        hash_ids: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        halo=None,
        document_distance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y with hidden's shape and dtype; exactly one of `hash_ids` [*, K] or `memory`
        [*, K * head_dim]. ``token_mask`` [*] (bool): False leaves the position unchanged
        (y = 0), as for V4.1's padding and image tokens. ``halo`` and ``document_distance``
        (the paper module's conv inputs) are accepted and unused: nothing here looks back."""
        del halo, document_distance
        if (hash_ids is None) == (memory is None):
            raise InputError("DeepseekV41Engram.forward needs exactly one of hash_ids or memory.")
        if memory is None:
            memory = self.lookup(hash_ids)
        lead = memory.shape[:-1]
        if memory.shape[-1] != self.memory_dim:
            raise InputError(f"memory shape {tuple(memory.shape)} must end in {self.memory_dim} "
                             "(hash heads x engram_head_dim).")
        hidden = self._streams(hidden_states, lead)
        g, d = self.hc_mult, self.hidden_size
        projected = self.wkv(memory.to(self.wkv.weight.dtype))
        key = projected[..., : g * d].float().unflatten(-1, (g, d))  # [*, G, d]
        value = projected[..., g * d :].float()  # [*, d], shared by the streams
        query = hidden.float()
        weight = self.q_weight.float() * self.k_weight.float()  # the two norms' weights, fused
        inv_rms = (torch.rsqrt(query.square().mean(-1) + self.eps)
                   * torch.rsqrt(key.square().mean(-1) + self.eps))
        dot = (query * weight * key).sum(-1) * inv_rms * d ** -0.5  # [*, G]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_SCORE_FLOOR).sqrt(), dot))
        if token_mask is not None:
            if token_mask.dtype != torch.bool or token_mask.shape != lead:
                raise InputError(f"token_mask must be bool of shape {tuple(lead)}, got "
                                 f"{token_mask.dtype} {tuple(token_mask.shape)}.")
            gate = gate.masked_fill(~token_mask.unsqueeze(-1), 0.0)
        y = (gate.unsqueeze(-1) * value.unsqueeze(-2)).to(hidden_states.dtype)  # [*, G, d]
        return y.squeeze(-2) if hidden.ndim != hidden_states.ndim else y

    def _streams(self, hidden_states: torch.Tensor, lead: torch.Size) -> torch.Tensor:
        """[*lead, G, d] (or [*lead, d] with G == 1) -> [*lead, G, d]; a clear error else."""
        shape = tuple(hidden_states.shape)
        if shape == (*lead, self.hc_mult, self.hidden_size):
            return hidden_states
        if self.hc_mult == 1 and shape == (*lead, self.hidden_size):
            return hidden_states.unsqueeze(-2)
        raise InputError(
            f"hidden_states shape {shape} does not match the hash ids' positions {tuple(lead)}: "
            f"expected {(*lead, self.hc_mult, self.hidden_size)} (hc_mult={self.hc_mult}, "
            f"hidden_size={self.hidden_size})."
        )
