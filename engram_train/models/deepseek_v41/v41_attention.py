"""DeepSeek-V4.1's attention: many query heads over one shared K=V head, a sliding window plus
(on compressed layers) the selected compressed keys of CSA2, a learned sink per head, RoPE on the
last channels with the inverse rotation on the output, and a grouped low-rank output.

Per token (sequence-first: ``[s, b, ...]``)::

    c   = q_norm(wq_a(x))                        # [q_lora_rank]
    q_h = rope(wq_b(c)_h)                        # H heads of head_dim
    kv  = fp8(rope(kv_norm(wkv(x))))             # one head of head_dim: key and value
    o_h = sum_j softmax_j(q_h . kv_j / sqrt(head_dim) ; sink_h) kv_j
    y   = wo_b(concat_g wo_a_g(concat_{h in g} rope^-1(o_h)))

where j runs over the window (keys ``i - sliding_window < j <= i``) and, on a compressed
layer, over the compressed keys the CSA2 selection gives query i (`v41_csa`); the sink is one
more logit per head whose value is zero (it only grows the softmax's denominator). Window layers
rotate with ``rope_theta``; compressed layers, window keys included, with
``compress_rope_theta`` and YaRN. The softmax runs in float32. Padding (``valid`` False, right
padding) is neither a key nor a compressed run, and its output is 0.

Tensor parallelism (with sequence parallelism): heads split (``wq_b`` column-parallel, the
sinks and the output groups by rank, ``wo_b`` row-parallel, reduce-scattering to the rank's
sequence slice); the input slice is gathered first, and ``wq_a``, ``wkv``, their norms, the
compressor and the indexer are replicated on the whole sequence. The shared KV head (and the
query latent) then take gradient from every rank's heads: the model marks these parameters
``sequence_parallel``, so megatron sums their gradients over TP.

The softmax over the keys runs in `v41_sparse_attention` (``attention_impl: sparse``, the
default): blocks of queries against their window and their selected keys, memory linear in the
sequence. ``attention_impl: dense`` builds the ``[b, H, s, s + t]`` scores (`_mask`,
`_attend`): the oracle the tests hold the sparse path to, and the only path with attention
dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram_train.errors import ConfigError, InputError
from engram_train.models.deepseek_v41.v41_args import FP8_BLOCK, NVFP4_BLOCK
from engram_train.models.deepseek_v41.v41_csa import (
    CSAState,
    DeepseekV41Compressor,
    DeepseekV41Indexer,
)
from engram_train.models.deepseek_v41.v41_hyper_connection import recomputed
from engram_train.models.deepseek_v41.v41_context_parallel import context_share
from engram_train.models.deepseek_v41.v41_documents import (
    local_positions,
    run_documents,
    segments,
)
from engram_train.models.deepseek_v41.v41_sparse_attention import sparse_attention
from engram_train.models.deepseek_v41.v41_primitives import (
    DeepseekV41RMSNorm,
    apply_rope,
    fake_quantize,
    layer_frequencies,
    rope_angles,
)


class GroupedLinear(nn.Module):
    """``wo_a``: one ``[out_per_group, in_per_group]`` projection per group, stored as one
    ``[groups * out_per_group, in_per_group]`` weight (the checkpoint's shape); tensor
    parallelism takes whole groups (rows) per rank."""

    def __init__(self, in_per_group: int, out_per_group: int, groups: int, device=None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.groups = int(groups)
        self.weight = nn.Parameter(torch.empty(groups * out_per_group, in_per_group,
                                               device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., groups, in]`` -> ``[..., groups, out]``."""
        lead, width = x.shape[:-2], x.shape[-1]
        weight = self.weight.view(self.groups, -1, width)
        out = torch.bmm(x.reshape(-1, self.groups, width).transpose(0, 1), weight.transpose(1, 2))
        return out.transpose(0, 1).reshape(*lead, self.groups, -1)


def parallel_linears(config, tp_group):
    """``(column, row)``: builders of megatron's ``ColumnParallelLinear`` (output split over
    `tp_group`) and ``RowParallelLinear`` (input split, output summed) for `config` (a megatron
    ``ModelParallelConfig``), bias-free; their forward returns ``(output, None)``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    def init(std):
        return lambda weight: nn.init.normal_(weight, mean=0.0, std=std)

    def column(width_in, width_out, std):
        return ColumnParallelLinear(width_in, width_out, config=config, init_method=init(std),
                                    bias=False, gather_output=False, skip_bias_add=True,
                                    tp_group=tp_group)

    def row(width_in, width_out, std):
        return RowParallelLinear(width_in, width_out, config=config, init_method=init(std),
                                 bias=False, input_is_parallel=True, skip_bias_add=True,
                                 tp_group=tp_group)

    return column, row


def tensor_parallel_size(tp_group) -> int:
    """The size of `tp_group`; without one, of the group megatron's linears default to."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return 1
    if tp_group is None:
        return (parallel_state.get_tensor_model_parallel_world_size()
                if parallel_state.model_parallel_is_initialized() else 1)
    return dist.get_world_size(tp_group)


def tensor_parallel_rank(tp_group) -> int:
    """This process's rank in `tp_group` (megatron's tensor-parallel group when None)."""
    if tp_group is not None:
        import torch.distributed as dist

        return dist.get_rank(tp_group)
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _check_tensor_parallel(args, config, tp: int) -> None:
    """Tensor parallelism splits the query heads, their sinks and the output groups; it runs
    with sequence parallelism (each rank's slice gathered before the attention, ``wo_b``
    reduce-scattering the output back)."""
    if tp == 1:
        return
    if args.num_attention_heads % tp or args.o_groups % tp:
        raise ConfigError(f"num_attention_heads={args.num_attention_heads} and o_groups="
                          f"{args.o_groups} must be divisible by tensor_model_parallel_size={tp}.")
    if not getattr(config, "sequence_parallel", False):
        raise ConfigError("DeepSeek-V4.1 with tensor_model_parallel_size > 1 needs "
                          "system.sequence_parallel: true.")


class DeepseekV41Attention(nn.Module):
    """The attention of layer `layer_id` (module docstring). `args` is a
    ``DeepseekV41BackboneArgs``; `config` the megatron ``ModelParallelConfig`` (or
    ``TransformerConfig``) of the column/row-parallel projections (their dtype is its
    ``params_dtype``; `dtype` is that of the others), `tp_group` their group.
    ``forward(x, state, valid)`` takes ``x [s, b, hidden]``, the `CSAState` the previous layer
    returned (a fresh one before layer 0) and optional ``valid [s, b]`` bool; it returns
    ``(y [s, b, hidden], state)``. `recompute_core_attention`: the softmax over the keys
    (`_attend`) keeps only its inputs and runs again in the backward (selective recompute's
    ``core_attn``)."""

    def __init__(self, args, layer_id: int, config, tp_group=None, device=None,
                 dtype: torch.dtype | None = None, recompute_core_attention: bool = False):
        super().__init__()
        self.recompute_core_attention = bool(recompute_core_attention)
        tp = self.tp = tensor_parallel_size(tp_group)
        self.tp_group = tp_group
        _check_tensor_parallel(args, config, tp)
        self.role = args.role(layer_id)
        self.layer_id, self.ratio = int(layer_id), self.role.compress_ratio
        self.num_heads, self.head_dim = args.num_attention_heads // tp, args.head_dim
        self.groups, self.window = args.o_groups // tp, args.sliding_window
        self.dropout = float(args.attention_dropout)
        self.sparse = args.attention_impl == "sparse"
        std, factory = args.initializer_range, {"device": device, "dtype": dtype}
        column, row = parallel_linears(config, tp_group)
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False, **factory)
        self.q_norm = DeepseekV41RMSNorm(args.q_lora_rank, args.rms_norm_eps, **factory)
        self.wq_b = column(args.q_lora_rank, args.num_attention_heads * self.head_dim, std)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False, **factory)
        self.kv_norm = DeepseekV41RMSNorm(self.head_dim, args.rms_norm_eps, **factory)
        self.wo_a = GroupedLinear(args.num_attention_heads * self.head_dim // args.o_groups,
                                  args.o_lora_rank, self.groups, **factory)
        self.wo_b = row(args.o_groups * args.o_lora_rank, args.hidden_size, std)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, device=device,
                                              dtype=torch.float32))
        self.compressor = (DeepseekV41Compressor(args, self.ratio, **factory)
                           if self.role.kv_source else None)
        self.indexer = (DeepseekV41Indexer(args, self.role, **factory)
                        if self.role.index_source else None)
        if tp > 1:  # this rank's heads and output groups: TP-split parameters for megatron
            from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

            for param in (self.wo_a.weight, self.attn_sink):
                set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.quantize = bool(args.fake_quantize)
        self.rope_args = args  # frequencies per call: a float buffer would follow a bf16 cast
        self.reset_parameters(std)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Projections normal(0, std), norms 1, sinks 0 (the released init)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, DeepseekV41RMSNorm):
                nn.init.ones_(module.weight)
        for weight in (self.wq_b.weight, self.wo_a.weight, self.wo_b.weight):
            nn.init.normal_(weight, mean=0.0, std=std)
        nn.init.zeros_(self.attn_sink)

    def forward(self, x: torch.Tensor, state: CSAState | None = None,
                valid: torch.Tensor | None = None, documents: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, CSAState]:
        """`valid` ``[s, b]`` bool (right padding) and `documents` ``[s, b]`` int (packed
        documents, `v41_documents`) describe the whole sequence, also under tensor
        parallelism (where `x` is this rank's slice) and context parallelism (where the rank
        holds its zigzag share, `v41_context_parallel`; no padding mask there)."""
        if self.tp > 1:  # this rank's sequence slice -> the whole sequence, for its heads
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            x = gather_from_sequence_parallel_region(x, True, self.tp_group)
        s, b = x.shape[:2]
        if s == 0:
            raise InputError("DeepSeek-V4.1 attention needs a non-empty sequence.")
        share = context_share(s, x.device)
        length = s if share is None else share.length
        if share is not None and (valid is not None or not self.sparse):
            raise InputError("DeepSeek-V4.1 under context parallelism runs the sparse "
                             "attention (attention_impl: sparse) without a padding mask.")
        if valid is not None and (valid.shape != (s, b) or valid.dtype != torch.bool):
            raise InputError(f"valid must be a bool [s, b] = [{s}, {b}] mask, got "
                             f"{tuple(valid.shape)} {valid.dtype}.")
        if documents is not None and (documents.shape != (length, b)
                                      or documents.is_floating_point()):
            raise InputError(f"documents must be integer [s, b] = [{length}, {b}] document ids "
                             f"of the whole sequence, got {tuple(documents.shape)} "
                             f"{documents.dtype}.")
        segment = segments(valid, documents)  # [length, b], or None
        state = CSAState() if state is None else state
        frequencies = layer_frequencies(self.rope_args, bool(self.ratio), x.device)
        positions = torch.arange(s, device=x.device) if share is None else share.positions
        if documents is not None:  # document-local positions of this rank's tokens
            positions = local_positions(segment).index_select(0, positions)
        angles = rope_angles(positions, frequencies)
        query_latent = self.q_norm(self.wq_a(x))
        heads = (self.wq_b(query_latent)[0] if self.tp == 1 else  # input already gathered
                 F.linear(query_latent, self.wq_b.weight))
        query = apply_rope(heads.unflatten(-1, (self.num_heads, -1)), angles)
        del heads  # [s, b, H d]: autograd keeps none of it; a long sequence's largest tensor
        kv = fake_quantize(apply_rope(self.kv_norm(self.wkv(x)), angles), "fp8", FP8_BLOCK,
                           self.quantize)
        if share is not None:
            kv = share.gather(kv)  # the whole sequence's window keys
        if self.ratio:
            state = self._compressed_state(x, query_latent, frequencies, positions, angles,
                                           state, valid, segment if documents is not None
                                           else None, share)
        if self.sparse:  # keeps its inputs and one log-sum-exp per query: recomputes anyway
            return self._output(self._sparse(query, kv, state, segment, share), angles,
                                valid), state
        mask = self._mask(s, b, x.device, state, segment)
        if self.ratio:
            kv = torch.cat((kv, state.compressed_kv), dim=0)
        attended = (recomputed(self._attend, query, kv, mask) if self.recompute_core_attention
                    else self._attend(query, kv, mask))
        return self._output(attended, angles, valid), state

    def _sparse(self, query, kv, state: CSAState, segment, share) -> torch.Tensor:
        """`v41_sparse_attention` over this rank's queries: all of them, or under context
        parallelism each of its two pieces against the whole sequence's keys."""
        compressed = state.compressed_kv if self.ratio else None
        indices = state.topk_indices if self.ratio else None

        def attend(start: int, stop: int, offset: int) -> torch.Tensor:
            return sparse_attention(query[start:stop], kv, compressed,
                                    None if indices is None else indices[start:stop], segment,
                                    self.attn_sink, self.window, self.head_dim ** -0.5, offset)

        if share is None:
            return attend(0, query.shape[0], 0)
        return torch.cat([attend(start, start + n, offset)
                          for start, offset, n in share.pieces()], dim=0)

    def _compressed_state(self, x, query_latent, frequencies, positions, angles,
                          state: CSAState, valid, documents, share=None) -> CSAState:
        """This layer's CSA2 state: a full layer's new compressed KV, an index layer's new
        selection, or the state as given (reuse). `documents` ``[length, b]`` (padding 0) or
        None; `share` this rank's context-parallel share (None: the whole sequence)."""
        s, b = x.shape[:2]
        length = s if share is None else share.length
        if share is not None:
            share.check_runs(self.ratio)
        runs = s // self.ratio
        compressed_angles = rope_angles(positions[: runs * self.ratio: self.ratio], frequencies)
        latent = None
        if self.compressor is not None:
            latent = self.compressor(x)
            kv = fake_quantize(apply_rope(latent, compressed_angles), "nvfp4", NVFP4_BLOCK,
                               self.quantize)
            if share is not None:
                kv = share.gather(kv, self.ratio)
            run_valid = None
            if valid is not None:
                run_valid = valid[: runs * self.ratio].unflatten(0, (runs, self.ratio)).all(1)
            state = CSAState(compressed_kv=kv, compressed_valid=run_valid,
                             compressed_documents=(None if documents is None else run_documents(
                                 documents, self.ratio, length // self.ratio)),
                             compression_ratio=self.ratio, candidates=state.candidates)
        elif state.compressed_kv is None or state.compression_ratio != self.ratio:
            raise InputError(f"layer {self.layer_id} ({self.role.kind}, ratio {self.ratio}) "
                             "needs the compressed KV of a full layer of the same ratio: pass "
                             "the state the previous layer returned.")
        if (documents is None) != (state.compressed_documents is None):
            raise InputError(f"layer {self.layer_id}: the CSA2 state was made "
                             f"{'without' if documents is not None else 'with'} packed "
                             "documents; pass the same documents to every layer.")
        if self.indexer is not None:
            state = self.indexer(x, query_latent, latent, angles, compressed_angles, state,
                                 documents, share)
        if state.topk_indices is None or state.topk_indices.shape[:2] != (s, b) \
                or state.compressed_kv.shape[:2] != (length // self.ratio, b):
            raise InputError(f"layer {self.layer_id}: the CSA2 state belongs to another batch "
                             "or sequence.")
        return state

    def _mask(self, s: int, b: int, device, state: CSAState, documents) -> torch.Tensor:
        """``[b, s, keys]`` bool: which window (and selected compressed) keys query i sees;
        `documents` ``[s, b]`` (padding 0) or None."""
        positions = torch.arange(s, device=device)
        offset = positions.unsqueeze(1) - positions.unsqueeze(0)  # query - key
        window = ((offset >= 0) & (offset < self.window)).unsqueeze(0).expand(b, s, s)
        if documents is not None:
            doc = documents.t()
            window = window & (doc.unsqueeze(1) == doc.unsqueeze(2)) & (doc != 0).unsqueeze(1)
        if not self.ratio:
            return window
        width = state.compressed_kv.shape[0]
        indices = state.topk_indices.transpose(0, 1)  # [b, s, k]; -1 goes to a spare column
        picked = torch.zeros(b, s, width + 1, dtype=torch.bool, device=device)
        picked = picked.scatter(-1, torch.where(indices >= 0, indices, width), True)
        return torch.cat((window, picked[..., :width]), dim=-1)

    def _attend(self, query: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention with the sink: ``query [s, b, H, d]``, ``kv [keys, b, d]``,
        ``mask [b, s, keys]`` -> ``[s, b, H, d]`` in query's dtype."""
        b, s = mask.shape[:2]
        logits = torch.einsum("sbhd,tbd->bhst", query.float(), kv.float()) * self.head_dim ** -0.5
        logits = logits.masked_fill(~mask.unsqueeze(1), -torch.inf)
        sink = self.attn_sink.float().view(1, -1, 1, 1).expand(b, -1, s, 1)
        probabilities = torch.cat((logits, sink), dim=-1).softmax(dim=-1)[..., :-1]
        probabilities = F.dropout(probabilities, p=self.dropout, training=self.training)
        return torch.einsum("bhst,tbd->sbhd", probabilities, kv.float()).to(query.dtype)

    def _output(self, attended: torch.Tensor, angles: torch.Tensor, valid) -> torch.Tensor:
        """The inverse rotation, ``wo_a`` per group, ``wo_b``; padding rows 0 (under tensor
        parallelism ``wo_b`` gives the rank its sequence slice: `valid`'s slice)."""
        attended = apply_rope(attended, angles, inverse=True)
        grouped = attended.reshape(*attended.shape[:2], self.groups, -1)
        out = self.wo_b(self.wo_a(grouped).flatten(2))[0]
        if valid is None:
            return out
        if self.tp > 1:
            share = valid.shape[0] // self.tp
            rank = tensor_parallel_rank(self.tp_group)
            valid = valid[rank * share:(rank + 1) * share]
        return out.masked_fill(~valid.unsqueeze(-1), 0)
