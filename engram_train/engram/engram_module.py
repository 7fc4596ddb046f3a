"""The Engram branch of one layer (spec section 3): memory lookup, context gate, short conv.

Layout follows megatron (sequence first): hidden [S, B, d] when hc_mult == 1, [S, B, G, d]
when hc_mult = G > 1; hash ids [S, B, K] int64 (K = (N-1) * H); memory [S, B, E] with
E = (N-1) * n_embed_per_ngram. The module returns y only: the caller adds the residual.
Submodule names equal the reference's so that its weights load by name. Imports at module
level are torch's only: the Hugging Face export copies this file into its folder, where the
table is a plain lookup passed in as ``table`` (engram_train.hf.modeling).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engram_train.errors import ConfigError, InputError

GATE_NORM_EPS = torch.finfo(torch.float32).eps  # key/query RMSNorms, as the reference
CONV_NORM_EPS = 1e-5  # ShortConv's RMSNorms
GATE_SCORE_FLOOR = 1e-6
def per_stream_rms_norm(x: torch.Tensor, norms: nn.ModuleList) -> torch.Tensor:
    """``norms[g](x[:, :, g])`` for every stream g at once: x [S, B, G, d] -> [S, B, G, d]
    (one RMSNorm kernel and one weight multiply instead of G of each)."""
    eps = norms[0].eps
    weight = torch.stack([norm.weight for norm in norms])  # [G, d]
    return nn.functional.rms_norm(x, (x.shape[-1],), eps=eps) * weight


class ShortConv(nn.Module):
    """Per-stream RMSNorm, then a causal depthwise conv over time (dilation = N), then SiLU.

    Channels are stream-major (channel = g * d + i), as the reference's conv weight [G*d, 1, K].
    """

    def __init__(self, hidden_size: int, hc_mult: int, kernel_size: int, dilation: int,
                 device=None, dtype=None) -> None:
        super().__init__()
        channels = hidden_size * hc_mult
        self.left_pad = (kernel_size - 1) * dilation
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False,
                              dilation=dilation, device=device, dtype=dtype)
        self.norms = nn.ModuleList(
            nn.RMSNorm(hidden_size, eps=CONV_NORM_EPS, device=device, dtype=dtype)
            for _ in range(hc_mult)
        )

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Each stream's RMSNorm: x [S, B, G, d] -> [S, B, G*d] (stream-major channels)."""
        seq, batch, streams, width = x.shape
        if streams == 1:
            return self.norms[0](x[:, :, 0])
        return per_stream_rms_norm(x, self.norms).reshape(seq, batch, streams * width)

    def forward(self, x: torch.Tensor, left_context: torch.Tensor | None = None,
                document_distance: torch.Tensor | None = None) -> torch.Tensor:
        """x [S, B, G, d] -> [S, B, G, d]. ``left_context`` [left_pad, B, G, d]: the conv input at
        the positions just before x's first one (a split sequence's halo); None is the
        reference's zero padding (an all-zero context normalizes to zero, the same thing).
        ``document_distance`` [S, B] (int): each position minus the start of its document
        (``engram_reset_at_eos``); a tap that would read before that start reads zero, as at
        the sequence's start, so a document's output does not depend on the one before it."""
        seq, batch, streams, width = x.shape
        if left_context is None:
            normed = self.normalize(x)
            y = nn.functional.pad(normed.permute(1, 2, 0), (self.left_pad, 0))  # [B, G*d, pad+S]
        else:
            if left_context.shape != (self.left_pad, *x.shape[1:]):
                raise InputError(f"left_context {tuple(left_context.shape)} must be "
                                 f"[{self.left_pad}, B, G, d] for x {tuple(x.shape)}")
            y = self.normalize(torch.cat([left_context, x])).permute(1, 2, 0)
        if document_distance is None:
            y = self.conv(y)
        else:
            if document_distance.shape != (seq, batch):
                raise InputError(f"document_distance {tuple(document_distance.shape)} must be "
                                 f"[S, B] = [{seq}, {batch}]")
            y = self._conv_within_documents(y, document_distance)
        y = nn.functional.silu(y)
        return y.permute(2, 0, 1).reshape(seq, batch, streams, width)

    def _conv_within_documents(self, y: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """The dilated conv as a sum of its K taps, tap i (lag (K-1-i) x N) masked where the
        lag reaches before the position's document: y [B, C, pad+S] -> [B, C, S]."""
        kernel, dilation = self.conv.kernel_size[0], self.conv.dilation[0]
        seq = y.shape[-1] - self.left_pad
        weight = self.conv.weight[:, 0, :]  # [C, K]
        within = distance.transpose(0, 1).unsqueeze(1)  # [B, 1, S]
        out = None
        for i in range(kernel):
            lag = (kernel - 1 - i) * dilation
            tap = y[:, :, i * dilation : i * dilation + seq] * weight[:, i : i + 1]
            if lag:
                tap = tap * (within >= lag).to(tap.dtype)
            out = tap if out is None else out + tap
        return out


class Engram(nn.Module):
    """Engram branch of global layer `layer_id`; `config` is an EngramConfig or a composed
    megatron config carrying its fields.

    `lookup(hash_ids)` and `forward(hidden, memory=...)` are split so that a prefetcher can
    fetch the memory of the next Engram layer early. `row_start`/`row_end` select the table
    rows this rank holds (default: all); `embedding_parallel` (a method object from
    `engram_train.parallel`) instead picks them and shards the lookup. The conv starts at zero
    (paper recipe) unless `zero_init_conv=False`.

    Dtypes: `dtype` is the dtype of the projections, norms and conv (the model's
    `params_dtype`: with bf16 they run in bf16 and keep the residual stream bf16). The table
    (`multi_head_embedding.weight`) is stored in `table_dtype`; it defaults to `dtype` when that
    is given (one dtype for the whole module), else to `config.engram_table_dtype`. The
    looked-up rows are cast to `dtype` before the projections. The Engram layer of the model
    passes both (`params_dtype` and `engram_table_dtype`).
    """

    def __init__(
        self,
        config,
        hidden_size: int,
        layer_id: int,
        *,
        row_start: int = 0,
        row_end: int | None = None,
        embedding_parallel=None,
        zero_init_conv: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        table_dtype: torch.dtype | None = None,
        table: nn.Module | None = None,
    ) -> None:
        super().__init__()
        layer_ids = list(config.engram_layer_ids)
        if layer_id not in layer_ids:
            raise ConfigError(
                f"layer_id={layer_id} is not in engram_layer_ids={layer_ids}: add it there (the "
                "table sizes depend on the whole list) or do not build Engram for this layer."
            )
        n_heads = config.n_head_per_ngram  # width rules: validated with the config
        self.layer_id = int(layer_id)
        self.hidden_size = int(hidden_size)
        self.hc_mult = int(config.engram_hc_mult)
        self.max_ngram_size = int(config.max_ngram_size)
        self.num_heads = (self.max_ngram_size - 1) * n_heads
        self.head_dim = config.n_embed_per_ngram // n_heads
        self.memory_dim = (self.max_ngram_size - 1) * config.n_embed_per_ngram
        self.init_std = float(config.engram_init_std)
        factory = {"device": device, "dtype": dtype}
        self.multi_head_embedding = table if table is not None else self._table(
            config, layer_ids, n_heads, row_start, row_end, embedding_parallel, device,
            dtype if table_dtype is None and dtype is not None else table_dtype)
        d, e, g = self.hidden_size, self.memory_dim, self.hc_mult
        self.value_proj = nn.Linear(e, d, **factory)
        self.key_projs = nn.ModuleList(nn.Linear(e, d, **factory) for _ in range(g))
        self.norm1 = nn.ModuleList(nn.RMSNorm(d, eps=GATE_NORM_EPS, **factory) for _ in range(g))
        self.norm2 = nn.ModuleList(nn.RMSNorm(d, eps=GATE_NORM_EPS, **factory) for _ in range(g))
        self.short_conv = ShortConv(d, g, config.engram_kernel_size, self.max_ngram_size,
                                    **factory)
        self.zero_init_conv = zero_init_conv
        # a namespace built from an exported config.json may predate these fields
        self.value_init = getattr(config, "engram_value_init", "normal")
        self.reset_parameters(include_table=False)  # the table initialized itself
        if table is None:
            from engram_train.engram.tables import mark_engram_param

            for param in self.parameters():
                mark_engram_param(param)

    def _table(self, config, layer_ids, n_heads, row_start, row_end, embedding_parallel,
               device, table_dtype):
        """The trainer's table: ``MultiHeadEmbedding`` sized by the layer's head primes."""
        from engram_train.config import engram_table_dtype
        from engram_train.engram.ngram_hash import engram_head_vocab_sizes
        from engram_train.engram.tables import MultiHeadEmbedding

        head_sizes = engram_head_vocab_sizes(
            config.engram_vocab_size, self.max_ngram_size, n_heads, layer_ids,
            one_row=getattr(config, "engram_one_row_per_head", False),
        )[self.layer_id]
        return MultiHeadEmbedding(
            [p for order in head_sizes for p in order],
            self.head_dim,
            layer_id=self.layer_id,
            seed=config.engram_seed,
            init_std=self.init_std,
            row_start=row_start,
            row_end=row_end,
            parallel=embedding_parallel,
            device=device,
            dtype=table_dtype if table_dtype is not None else engram_table_dtype(config),
            placement=config.engram_table_placement,
        )

    @torch.no_grad()
    def reset_parameters(self, include_table: bool = True) -> None:
        """Projections ~ N(0, engram_init_std^2) with zero bias, norms at one, conv at zero."""
        for linear in [self.value_proj, *self.key_projs]:
            linear.weight.normal_(0.0, self.init_std)
            linear.bias.zero_()
        if self.value_init == "zero":  # the branch adds nothing until it has learned
            self.value_proj.weight.zero_()
        for norm in [*self.norm1, *self.norm2, *self.short_conv.norms]:
            norm.reset_parameters()
        if self.zero_init_conv:
            self.short_conv.conv.weight.zero_()
        else:
            self.short_conv.conv.reset_parameters()
        if include_table:
            self.multi_head_embedding.reset_parameters()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """megatron dist_checkpointing view (megatron's layer calls it for its children): the
        table as a row-sharded tensor (``MultiHeadEmbedding.sharded_state_dict``), every other
        tensor replicated as megatron's default treats a plain module."""
        from megatron.core.transformer.utils import sharded_state_dict_default

        from engram_train.engram.tables import _tensor_parallel_group

        state = {}
        for name, child in self.named_children():
            state.update(sharded_state_dict_default(
                child, f"{prefix}{name}.", sharded_offsets, metadata,
                tp_group=_tensor_parallel_group(),
            ))
        return state

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """Hash ids [S, B, K] (head-local, as NgramHashMapping gives) -> memory [S, B, E]."""
        return self.issue_lookup(hash_ids, prefetch=False).wait()

    def issue_lookup(self, hash_ids: torch.Tensor, prefetch: bool = True):
        """Start ``lookup`` early (the model's next-layer prefetch): ``wait()`` on the result
        gives the memory, which ``forward(hidden, memory=...)`` takes."""
        return self.multi_head_embedding.issue(hash_ids, prefetch=prefetch)

    def forward(
        self,
        hidden_states: torch.Tensor,
        hash_ids: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        halo=None,
        document_distance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """y with hidden's shape; give exactly one of `hash_ids` [S, B, K] or `memory` [S, B, E].
        ``halo`` (``parallel.context.SequenceHalo``): the rows are a split sequence's pieces; the
        conv of each piece reads its left context from the ranks holding the positions before.
        ``document_distance`` [S, B] (``engram_reset_at_eos``): the conv's look-back stops at
        each position's document start (`ShortConv.forward`), the halo's rows included."""
        if (hash_ids is None) == (memory is None):
            raise InputError("Engram.forward needs exactly one of hash_ids or memory.")
        if memory is None:
            memory = self.lookup(hash_ids)
        hidden = self._streams(hidden_states)
        if memory.shape != (*hidden.shape[:2], self.memory_dim):
            raise InputError(
                f"memory shape {tuple(memory.shape)} does not match hidden {tuple(hidden.shape)}:"
                f" expected [S, B, {self.memory_dim}] (sequence first)."
            )
        memory = memory.to(self.value_proj.weight.dtype)
        scale = 1.0 / math.sqrt(self.hidden_size)
        if self.hc_mult == 1:
            key = self.norm1[0](self.key_projs[0](memory))
            query = self.norm2[0](hidden[:, :, 0])
            score = (key * query).sum(dim=-1, keepdim=True).unsqueeze(-1)  # [S, B, 1, 1]
        else:  # every stream's key projection and norms at once (one GEMM, two norm kernels)
            weight = torch.cat([proj.weight for proj in self.key_projs])  # [G*d, E]
            bias = torch.cat([proj.bias for proj in self.key_projs])
            keys = nn.functional.linear(memory, weight, bias).unflatten(-1, (self.hc_mult, -1))
            key = per_stream_rms_norm(keys, self.norm1)
            query = per_stream_rms_norm(hidden, self.norm2)
            score = (key * query).sum(dim=-1, keepdim=True)  # [S, B, G, 1]
        score = score * scale
        score = score.abs().clamp_min(GATE_SCORE_FLOOR).sqrt() * score.sign()
        gate = score.sigmoid()  # [S, B, G, 1]
        value = gate * self.value_proj(memory).unsqueeze(2)  # one value projection, G gates
        y = value + self._conv(value, halo, document_distance)
        return y.squeeze(2) if hidden_states.ndim == 3 else y

    def _conv(self, value: torch.Tensor, halo, distance: torch.Tensor | None) -> torch.Tensor:
        """The short conv over the sequence, or over each piece with its exchanged halo."""
        if halo is None:
            return self.short_conv(value, document_distance=distance)
        pieces, left = halo.left_contexts(value)
        return torch.cat([
            self.short_conv(value[start:end], left[k],
                            document_distance=None if distance is None else distance[start:end])
            for k, (start, end) in enumerate(pieces)])

    def _streams(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[S, B, d] (G == 1) or [S, B, G, d] -> [S, B, G, d], with a clear error otherwise."""
        expected = "[S, B, d]" if self.hc_mult == 1 else f"[S, B, {self.hc_mult}, d]"
        ok = hidden_states.shape[-1] == self.hidden_size and (
            (hidden_states.ndim == 3 and self.hc_mult == 1)
            or (hidden_states.ndim == 4 and hidden_states.shape[2] == self.hc_mult)
        )
        if not ok:
            raise InputError(
                f"hidden_states shape {tuple(hidden_states.shape)} does not match {expected} "
                f"with d={self.hidden_size} (engram_hc_mult={self.hc_mult}, sequence first)."
            )
        return hidden_states.unsqueeze(2) if hidden_states.ndim == 3 else hidden_states
