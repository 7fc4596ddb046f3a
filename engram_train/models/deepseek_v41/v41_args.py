"""The backbone fields of a DeepSeek-V4.1 text config, under V4.1's names, and the role of each
layer in the CSA2 schedule.

`DeepseekV41BackboneArgs` holds what the attention, the compressed branch, the MoE and mHC read
(the Engram fields are `engram.v41_ngram_hash.DeepseekV41EngramArgs`). Its defaults are the
released V4.1-Flash values; `validate` refuses a schedule the blocks cannot run, naming the field.

The schedule, per layer ``i`` (``compress_ratios[i]``, the three id lists):

- ratio 0: **window** layer, sliding-window attention only (RoPE base ``rope_theta``, no YaRN);
- ratio r > 0 (RoPE base ``compress_rope_theta`` with YaRN, for the window and the compressed
  keys alike): the window plus compressed keys, one per r tokens:
  - **full** (``i`` in ``kv_source_layer_ids``): owns the compressor and the indexer's key
    projection; publishes the compressed KV, the index keys and a top-k selection;
  - **reindex** (``i`` in ``index_source_layer_ids`` only): scores the published keys with its
    own indexer queries and replaces the selection;
  - **reuse** (neither): attends over the published KV with the selection as published.
- ``candidate_source_layer_id`` (a full layer, -1: none) also publishes candidate blocks: the
  indexers of every later index layer select only inside them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from engram_train.errors import ConfigError

FP8_BLOCK = 32
"""Channels per scale of the window KV's FP8 fake quantization (and of the indexer's FP4)."""
NVFP4_BLOCK = 16
"""Channels per scale of the compressed KV's FP4 fake quantization (E4M3 scales)."""


@dataclass(frozen=True)
class YarnScaling:
    """The frequency-only YaRN of the compressed layers' RoPE (released: factor 16 over 65536)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class LayerRole:
    """What layer `layer_id` does in the CSA2 schedule (module docstring)."""

    layer_id: int
    compress_ratio: int
    kv_source: bool
    index_source: bool
    candidate_source: bool
    uses_candidates: bool

    @property
    def kind(self) -> str:
        """'window', 'full', 'reindex' or 'reuse'."""
        if not self.compress_ratio:
            return "window"
        if self.kv_source:
            return "full"
        return "reindex" if self.index_source else "reuse"


def _released_ratios() -> tuple[int, ...]:
    return (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3


@dataclass(frozen=True)
class DeepseekV41BackboneArgs:
    """Backbone fields of a V4.1 text config (defaults: the released V4.1-Flash)."""

    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    """Query heads; one K=V head of width ``head_dim`` is shared by all of them."""
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    """Trailing channels of each head (and of the index heads) rotated by RoPE, in pairs."""
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    """Width of each output group's projection (``wo_a``)."""
    o_groups: int = 8
    sliding_window: int = 128
    """Keys a query sees in its window, itself included."""
    attention_dropout: float = 0.0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = field(default_factory=YarnScaling)
    """YaRN of the compressed layers (None: none); window layers never scale."""
    compress_ratios: tuple[int, ...] = field(default_factory=_released_ratios)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    initializer_range: float = 0.02
    fake_quantize: bool = True
    """The released caches' FP8/FP4 rounding inside the forward (false: float throughout; a
    layout comparison's setting, docs/deepseek-v41.md 'Layouts')."""
    moe_router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free load balancing: the router's correction bias moves by this much per
    optimizer step against each expert's load (0: off, the bias as imported; DeepSeek-V3 used
    1e-3; ``v41_load_balance``)."""
    document_eos_id: int | None = None
    """Packed documents (NeMo's ``packed_seq_ids``, `v41_documents`): the raw token id that
    ends a document in the trainer's EOS-delimited rows; attention, compression and selection
    then stay inside documents and positions restart with each. None: a row is one document."""
    attention_impl: str = "sparse"
    """``sparse``: each query's window and selected keys in blocks of queries, memory linear in
    the sequence (`v41_sparse_attention`); ``dense``: the ``[b, heads, s, s + t]`` reference
    scores (the tests' oracle; needed for ``attention_dropout`` > 0)."""

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.rope_scaling, dict):
            keys = {f.name for f in dataclasses.fields(YarnScaling)}
            object.__setattr__(self, "rope_scaling", YarnScaling(
                **{k: v for k, v in self.rope_scaling.items() if k in keys}))
        self.validate()

    def validate(self) -> None:
        """Refuse what the blocks cannot run (a ConfigError naming the field)."""
        self._validate_sizes()
        self._validate_schedule()

    def _validate_sizes(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                     "sliding_window", "index_n_heads", "index_head_dim", "index_topk",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                     "hc_mult", "hc_sinkhorn_iters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer.")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} must be a multiple "
                              f"of o_groups={self.o_groups}.")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim,
                                                                     self.index_head_dim):
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most "
                              f"head_dim={self.head_dim} and index_head_dim={self.index_head_dim}.")
        for name, block in (("head_dim", FP8_BLOCK), ("index_head_dim", FP8_BLOCK)):
            if getattr(self, name) % block:
                raise ConfigError(f"{name}={getattr(self, name)} must be a multiple of {block}: "
                                  "its fake quantization takes one scale per block of "
                                  f"{block} channels.")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"n_routed_experts={self.n_routed_experts}.")
        if self.n_shared_experts != 1:
            raise ConfigError(f"n_shared_experts={self.n_shared_experts}: V4.1 has exactly one.")
        if self.scoring_func != "sqrtsoftplus":
            raise ConfigError(f"scoring_func={self.scoring_func!r}: V4.1 routes with "
                              "'sqrtsoftplus'.")
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta",
                     "routed_scaling_factor", "initializer_range"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value!r} must be finite and positive.")
        if not (math.isfinite(self.swiglu_limit) and self.swiglu_limit >= 0):
            raise ConfigError(f"swiglu_limit={self.swiglu_limit!r} must be >= 0 (0: no clamp).")
        rate = self.moe_router_bias_update_rate
        if not (math.isfinite(rate) and rate >= 0):
            raise ConfigError(f"moe_router_bias_update_rate={rate!r} must be finite and >= 0 "
                              "(0: no load balancing; DeepSeek-V3 used 1e-3).")
        if not 0 <= self.attention_dropout < 1:
            raise ConfigError(f"attention_dropout={self.attention_dropout!r} must be in [0, 1).")
        if self.document_eos_id is not None and (isinstance(self.document_eos_id, bool)
                                                 or not isinstance(self.document_eos_id, int)
                                                 or self.document_eos_id < 0):
            raise ConfigError(f"document_eos_id={self.document_eos_id!r} must be the "
                              "tokenizer's EOS id (an int >= 0) or null.")
        if self.attention_impl not in ("sparse", "dense"):
            raise ConfigError(f"attention_impl={self.attention_impl!r}: one of 'sparse' (linear "
                              "in the sequence) or 'dense' (the reference scores).")
        if self.attention_dropout and self.attention_impl == "sparse":
            raise ConfigError(f"attention_dropout={self.attention_dropout} needs "
                              "attention_impl=dense: the sparse attention has no dropout "
                              "(V4.1 trains without: 0).")

    def _validate_schedule(self) -> None:
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n:
            raise ConfigError(f"compress_ratios has {len(self.compress_ratios)} entries for "
                              f"num_hidden_layers={n}: give one ratio per layer.")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0
               for r in self.compress_ratios):
            raise ConfigError(f"compress_ratios={list(self.compress_ratios)} must hold "
                              "integers >= 0.")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = list(getattr(self, name))
            if ids != sorted(set(ids)) or any(i < 0 or i >= len(self.compress_ratios)
                                              for i in ids):
                raise ConfigError(f"{name}={ids} must be strictly increasing layer ids "
                                  "covered by compress_ratios.")
        missing = set(self.kv_source_layer_ids) - set(self.index_source_layer_ids)
        if missing:
            raise ConfigError(f"kv_source_layer_ids {sorted(missing)} are not in "
                              "index_source_layer_ids: a full layer also indexes.")
        self._validate_sources(n)
        self._validate_candidates(n)

    def _validate_sources(self, n: int) -> None:
        source_ratio = None
        for i in range(n):
            ratio = self.compress_ratios[i]
            sources = i in self.kv_source_layer_ids or i in self.index_source_layer_ids
            if ratio == 0 and sources:
                raise ConfigError(f"layer {i} has compress_ratios[{i}]=0 (window only) but is "
                                  "a kv or index source.")
            if i in self.kv_source_layer_ids:
                source_ratio = ratio
            if ratio and source_ratio != ratio:
                raise ConfigError(f"layer {i} (compress ratio {ratio}) has no kv source of the "
                                  "same ratio at or before it in kv_source_layer_ids.")

    def _validate_candidates(self, n: int) -> None:
        c = self.candidate_source_layer_id
        if c == -1:
            return
        if c not in self.kv_source_layer_ids:
            raise ConfigError(f"candidate_source_layer_id={c} must be -1 or one of "
                              f"kv_source_layer_ids={list(self.kv_source_layer_ids)}.")
        if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
            raise ConfigError("candidate_block_size and candidate_topk_blocks must be >= 1.")
        for i in self.index_source_layer_ids:
            if c < i < n and self.compress_ratios[i] != self.compress_ratios[c]:
                raise ConfigError(
                    f"index layer {i} (ratio {self.compress_ratios[i]}) follows the candidate "
                    f"source {c} (ratio {self.compress_ratios[c]}): it selects inside the "
                    "candidates, which need the same compressed width.")

    def role(self, layer_id: int) -> LayerRole:
        """The CSA2 role of layer `layer_id` (0-based)."""
        if not 0 <= layer_id < self.num_hidden_layers:
            raise ConfigError(f"layer_id={layer_id} outside num_hidden_layers="
                              f"{self.num_hidden_layers}.")
        c = self.candidate_source_layer_id
        return LayerRole(
            layer_id=layer_id, compress_ratio=self.compress_ratios[layer_id],
            kv_source=layer_id in self.kv_source_layer_ids,
            index_source=layer_id in self.index_source_layer_ids,
            candidate_source=layer_id == c, uses_candidates=0 <= c < layer_id,
        )
