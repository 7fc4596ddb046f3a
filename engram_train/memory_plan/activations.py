"""One micro-batch's activations on one rank, by layer type, and how many are in flight.

Each layer type has its own function giving the bytes autograd keeps per token for the
backward (the tensors its forward saves), in the activation dtype ``a`` (2 for bf16, 4 for
fp32) plus the float32 extras (softmax statistics, router probabilities). Hidden-sized tensors
are split over TP under sequence parallelism; heads and FFN widths over TP always. Recompute:
``full`` keeps only each layer's input (one layer is rebuilt at a time in the backward);
``selective`` recomputes the core attention (with a fused attention kernel, as on CPU and
under flash attention, it saves nothing larger than its output anyway).

mHC is apart (``MHC_ACTIVATIONS``, keyed by the mHC recompute option) so that a change of what
the mHC layer saves is one entry.

In flight: without a pipeline one micro-batch is alive at a time; with 1F1B stage ``s`` holds
``min(PP - s, micro-batches)`` (megatron's warm-up), with a virtual pipeline
``(PP - s - 1) x 2 + (VPP - 1) x PP + 1`` model chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from engram_train.models.families import family_of
from engram_train.memory_plan.plan_layout import Layout


@dataclass(frozen=True)
class Widths:
    """The per-token widths of one rank (already divided by TP where megatron splits)."""

    h: int  # hidden, as held between layers (h / TP under sequence parallelism)
    h_full: int  # hidden inside a sublayer (gathered under sequence parallelism)
    tp: int


def widths(config, layout: Layout) -> Widths:
    h = config.hidden_size
    return Widths(h=h // layout.tp if layout.sequence_parallel else h, h_full=h, tp=layout.tp)


def attention_per_token(config, w: Widths, a: int) -> int:
    """MLA (or standard attention): norms, latent down/up projections, rotated q/k, v, the
    attention output and the output projection's input; float32 log-sum-exp per head."""
    heads = config.num_attention_heads // w.tp
    if config.q_lora_rank or config.kv_lora_rank:
        qk, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        q_lora = config.q_lora_rank or 0
        latent = 2 * q_lora + 2 * config.kv_lora_rank + rope
        per_head = 3 * (qk + rope) + (qk + v) + 2 * v
    else:
        kv = config.kv_channels
        latent = 0
        per_head = 3 * kv + 2 * kv
    return a * (w.h + w.h_full + latent + heads * per_head) + 4 * heads


# SwiGLU MLP: fc1's output (gate and up), the activation's saved inputs and output and fc2's
# input come to about 6 x its width per token (measured with saved-tensor hooks on the CPU).
SWIGLU_SAVED = 6


def dense_mlp_per_token(config, w: Widths, a: int) -> int:
    """Norm input and output, and the SwiGLU MLP."""
    f = config.ffn_hidden_size // w.tp
    return a * (w.h + w.h_full + SWIGLU_SAVED * f)


# torch's SDPA math path on the CPU computes in float32 whatever the activation dtype and saves
# the probabilities, one float32 [b, heads, s, s] per layer; while one layer runs (its forward:
# scores, masked scores, probabilities; its backward: the probabilities' gradient and the
# softmax's) it holds 2.3-2.75 more of them (measured: benchmarks/measure_memory_plan.py
# --scores, 1 and 4 layers, fp32 and bf16, s 1024 and 2048).
SCORE_TRANSIENTS = 2.75


def attention_scores_per_layer(config, layout: Layout, a: int, device: str) -> int:
    """The attention probabilities one layer saves, where attention is not fused: torch's SDPA
    on the CPU takes its math path when the q/k and v head dims differ (MLA) or with dropout,
    and saves ``[b, heads, s, s]`` in float32 (``a`` does not matter: the math path upcasts).
    Fused kernels (flash, Transformer Engine on the GPU) save none."""
    if device != "cpu":
        return 0
    qk = (config.qk_head_dim + config.qk_pos_emb_head_dim) if config.kv_lora_rank else config.kv_channels
    v = config.v_head_dim if config.kv_lora_rank else config.kv_channels
    if qk == v and not config.attention_dropout:
        return 0
    heads = config.num_attention_heads // layout.tp
    s = layout.seq_length // layout.cp
    return layout.micro_batch_size * heads * s * layout.seq_length * 4


def moe_per_token(config, w: Widths, a: int) -> int:
    """Norm, router (float32 logits, scores, probabilities), the dispatcher's permuted tokens
    and its exchange buffers (top-k copies of the hidden state), each routed expert's fc1
    input/output and SwiGLU output, the unpermute, and the shared experts."""
    k, e = config.moe_router_topk, config.num_moe_experts
    f = config.moe_ffn_hidden_size
    shared = (config.moe_shared_expert_intermediate_size or 0) // w.tp
    etp = w.tp  # expert TP follows TP (the project does not set it apart)
    routed = k * (3 * w.h_full + SWIGLU_SAVED * f // etp)
    return a * (w.h + w.h_full + routed + w.h_full + SWIGLU_SAVED * shared) + 4 * 3 * e


def engram_per_token(config, w: Widths, a: int) -> int:
    """The Engram branch: gathered rows (float32 from the table, then in ``a``), key and
    value projections, per-stream gate norms, the short conv and its norms."""
    memory = (config.max_ngram_size - 1) * config.n_embed_per_ngram
    g = config.engram_hc_mult
    table = 4 if config.engram_table_dtype == "fp32" else 2
    return table * memory + a * (memory + 8 * g * w.h_full)


def _mhc_none(n: int, w: Widths, a: int, iterations: int) -> int:
    """No mHC recompute: the streams in, and in float32 the logits, the gates and the
    Sinkhorn's 2T-1 intermediate n x n matrices and their sums, per sublayer (no float32 copy
    of the streams: ``models/hyper_connection.normalized_projection``)."""
    small = (2 * iterations - 1) * (n * n + n) + n * n + (2 + n) * n + 2 * n
    return _mhc_recomputed(n, w, a, iterations) + 4 * small


def _mhc_recomputed(n: int, w: Widths, a: int, iterations: int) -> int:
    """mHC recomputed: the streams in and the mappings."""
    return a * n * w.h_full + 4 * (n * n + 2 * n) * 4


MHC_ACTIVATIONS = {None: _mhc_none, "mhc": _mhc_recomputed}


def mhc_per_token(config, w: Widths, a: int) -> int:
    """Both sublayers (attention, MLP/MoE) of one layer."""
    if not config.enable_hyper_connections:
        return 0
    modules = config.recompute_modules or []
    key = "mhc" if config.recompute_granularity == "selective" and "mhc" in modules else None
    return 2 * MHC_ACTIVATIONS[key](config.num_residual_streams, w, a,
                                    config.mhc_sinkhorn_iterations)


def layer_kinds(config) -> list[str]:
    """``"dense"`` or ``"moe"`` for each layer (megatron's ``moe_layer_freq``)."""
    freq = config.moe_layer_freq
    if not config.num_moe_experts:
        return ["dense"] * config.num_layers
    if isinstance(freq, int):
        return ["moe" if i % freq == 0 else "dense" for i in range(config.num_layers)]
    return ["moe" if f else "dense" for f in freq]


def layer_per_token(config, w: Widths, a: int, layer: int, kind: str) -> dict[str, int]:
    """Bytes per token of one layer, by part (before recompute)."""
    parts = {"attention": attention_per_token(config, w, a)}
    parts["moe" if kind == "moe" else "dense_mlp"] = (
        moe_per_token(config, w, a) if kind == "moe" else dense_mlp_per_token(config, w, a))
    if config.use_engram and layer in config.engram_layer_ids:
        parts["engram"] = engram_per_token(config, w, a)
    mhc = mhc_per_token(config, w, a)
    if mhc:
        parts["mhc"] = mhc
    return parts


def in_flight_chunks(stage: int, layout: Layout) -> tuple[int, int]:
    """(model chunks alive at the peak, layers per chunk) on pipeline stage ``stage``."""
    if layout.pp == 1:
        return 1, 0
    if layout.vpp:
        alive = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
        return min(alive, layout.num_micro * layout.vpp), 0
    return min(layout.pp - stage, layout.num_micro), 0


def stage_activations(config, layout: Layout, stage: int, layers: list[int], a: int,
                      vocab: int, device: str = "cuda") -> dict[str, int]:
    """Activation bytes of stage ``stage`` at its peak, by item: every micro-batch in flight,
    the backward's working set (one layer's gradients, or one recomputed layer), logits and
    the loss on the last stage, the embedding output on the first."""
    w = widths(config, layout)
    t = layout.tokens
    terms = family_of(config).plan  # the family's own terms (DeepSeek-V4.1's), or None
    if terms is not None:
        per_layer = [terms.layer_per_token(config, layout, a, i) for i in layers]
    else:
        kinds = layer_kinds(config)
        per_layer = [layer_per_token(config, w, a, i, kinds[i]) for i in layers]
    n = config.num_residual_streams if config.enable_hyper_connections else 1
    if terms is not None:
        n = terms.residual_streams(config)
    full = config.recompute_granularity == "full"
    chunks, _ = in_flight_chunks(stage, layout)
    per_chunk = (layout.vpp or 1)
    items: dict[str, int] = {}
    if full:
        items["layer_inputs (full recompute)"] = len(layers) * t * a * n * w.h
    else:
        for parts in per_layer:
            for part, b in parts.items():
                items[part] = items.get(part, 0) + t * b
        scores = _scores(config, layout, a, device, layers)
        if scores:
            items["attention_scores (unfused)"] = scores
    # micro-batches (or model chunks) in flight on this stage
    scale = chunks / per_chunk if layout.vpp else chunks
    items = {k: int(v * scale) for k, v in items.items()}
    one_layer = max((sum(p.values()) for p in per_layer), default=0) * t
    items["backward_working_set"] = one_layer * (2 if full else 1)
    if terms is not None:  # V4.1: the indexer's and the sparse attention's blocks, per layer
        transients = (terms.layer_transient(config, layout, i, a) for i in layers)
        items["backward_working_set"] += max(transients, default=0)
    scores = 0 if terms is not None else attention_scores_per_layer(config, layout, a, device)
    if scores:  # one layer's float32 score transients (plus its saved ones under full recompute)
        items["attention_score_transients"] = int(scores * (SCORE_TRANSIENTS + (1 if full else 0)))
    if stage == 0:
        items["embedding_output"] = t * a * n * w.h * chunks
    if stage == layout.pp - 1:
        entry = terms.logits_bytes_per_entry(a) if terms is not None else a + 4 + 4
        items["logits_and_loss"] = t * (vocab // layout.tp) * entry
        if terms is not None:
            items["backward_working_set"] = terms.backward_beyond_logits(
                items["backward_working_set"], items["logits_and_loss"])
    return items


def single_tensor_bytes(config, layout: Layout, vocab: int, device: str) -> dict[str, int]:
    """The size of one tensor of the activation items made of large single tensors (the CPU's
    unfused attention scores, the float32 logits); the CPU heap's model needs it, since glibc
    mmaps a tensor of 32 MiB or more and leaves no hole where it was (cpu_heap.py)."""
    out = {"logits_and_loss": layout.tokens * (vocab // layout.tp) * 4}
    if family_of(config).plan is None:
        score = attention_scores_per_layer(config, layout, 4, device)
        out["attention_scores (unfused)"] = out["attention_score_transients"] = score
    return out


def _scores(config, layout: Layout, a: int, device: str, layers: list[int]) -> int:
    """Unfused attention scores the stage's layers keep (the CPU's attention only)."""
    terms = family_of(config).plan
    if terms is None:
        return attention_scores_per_layer(config, layout, a, device) * len(layers)
    return sum(terms.scores_per_layer(config, layout, i) for i in layers)


def prefetch_bytes(config, layout: Layout) -> int:
    """Host: the hash-id blocks of a step hashed ahead (int64 ``[L, B, S, K]`` per
    micro-batch, the next step's while this one runs) and the token batches."""
    tokens = layout.micro_batch_size * layout.seq_length
    batches = tokens * 8 * 4 * 2 * layout.num_micro
    if not config.use_engram:
        return batches
    k = (config.max_ngram_size - 1) * config.n_head_per_ngram
    ids = len(config.engram_layer_ids) * tokens * k * 8
    return batches + ids * (2 * layout.num_micro + 1)
